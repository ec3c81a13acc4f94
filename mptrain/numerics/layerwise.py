"""Layer-by-layer comparison of a low-precision model against its fp32 shadow.

Two deep copies run the same input, one in float32, one converted by a precision of
:mod:`mptrain.precision`; hooks on every leaf module (and every module owning parameters)
record what each computed.  Per module: the **global** error (low output vs fp32 output,
upstream damage included) and the **local** error (the low module re-run on its shadow's
fp32 input, cast to the dtype it really got): the error the layer adds, which ranks the
table.  A layer that turns a finite input into inf/NaN (``new_nonfinite``) ranks first.
Statistics stay on the device until the end (one host transfer for the report).
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from mptrain.compat import torch as compat

_pytree = compat.pytree()
tree_leaves, tree_map_only = _pytree.tree_leaves, _pytree.tree_map_only

#: the keys of every row, in this order (outside tests rely on exactly these)
ROW_KEYS = ("module", "max_abs", "max_rel", "mean_abs", "cosine", "ok", "overflow_frac", "underflow_frac")

#: unit roundoff (half the machine epsilon) of each dtype: the relative error of one rounding
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
#: default multiple of the unit roundoff a healthy layer stays within (the largest element
#: error of a tensor with thousands of values is several standard deviations of the mean one)
TOL_FACTOR = 8.0
#: a module's own error (its low-precision run on the fp32 input, relative L2) stays within
#: this multiple of u: one rounding of inputs, weights and output gives about u/sqrt(3) each
LOCAL_FACTOR = 4.0


@dataclass(frozen=True)
class Tolerance:
    """What "ok" means for one module: ``|low - fp32| <= atol + rtol * |fp32|`` element-wise.

    By default ``rtol = TOL_FACTOR * u * sqrt(depth)``: ``u`` the low dtype's unit roundoff, ``depth``
    the number of modules with parameters run so far (independent roundings add up like a random
    walk; a layer's reduction size K does not widen it, products accumulate in fp32), and
    ``atol = rtol * rms(fp32 output)``.  The module's own error (relative L2 on its fp32 input)
    must also stay within ``LOCAL_FACTOR * u``: that catches one wrong layer whose damage is small
    next to the inherited error.  An explicit ``rtol`` / ``atol`` is used for every module (and
    rtol bounds the own error too)."""

    unit_roundoff: float
    rtol: Optional[float] = None
    atol: Optional[float] = None

    def rtol_at(self, depth: int) -> float:
        return self.rtol if self.rtol is not None else TOL_FACTOR * self.unit_roundoff * math.sqrt(depth)

    def local_limit(self) -> float:
        return self.rtol if self.rtol is not None else LOCAL_FACTOR * self.unit_roundoff

    def describe(self) -> str:
        r = f"rtol={self.rtol}" if self.rtol is not None else \
            f"rtol={TOL_FACTOR:g}*u*sqrt(depth), u=2^{int(math.log2(self.unit_roundoff))}"
        a = f"atol={self.atol}" if self.atol is not None else "atol=rtol*rms(output)"
        own = "" if self.rtol is not None else f", own error <= {LOCAL_FACTOR:g}*u"
        return f"{r}, {a}{own}"


def _unit_roundoff(precision_name: str) -> float:
    """The unit roundoff of the low dtype a precision name computes in ("bf16-*", "16-*", else fp32)."""
    prefixes = {"bf16": torch.bfloat16, "16": torch.float16}
    return UNIT_ROUNDOFF[next((d for p, d in prefixes.items() if precision_name.startswith(p)), torch.float32)]


# Index of each statistic in the per-call vector (summed or max-ed over calls at the end).
_N, _NBOTH, _SUMABS, _MAXABS, _MAXREL, _DOT, _REF2, _LOW2, _D2, _OVF, _UNF, _VIOL, _MISMATCH = range(13)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Floating-point tensors in ``obj`` (tensors, lists, tuples, dicts), in a fixed order."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _cast_like(ref: Any, low: Any) -> Any:
    """fp32 ``ref`` values in the dtypes of the matching tensors of ``low`` (same structure)."""
    if isinstance(ref, torch.Tensor):
        if isinstance(low, torch.Tensor) and ref.is_floating_point() and low.is_floating_point():
            return ref.detach().to(device=low.device, dtype=low.dtype)
        return ref.detach().clone()
    if isinstance(ref, dict) and isinstance(low, dict):
        return {k: _cast_like(v, low.get(k)) for k, v in ref.items()}
    if isinstance(ref, (list, tuple)) and isinstance(low, (list, tuple)) and len(ref) == len(low):
        out = [_cast_like(r, l) for r, l in zip(ref, low)]
        return tuple(out) if isinstance(ref, tuple) else out
    return ref


def _call(model: nn.Module, inp: Any) -> Any:
    if isinstance(inp, dict):
        return model(**inp)
    if isinstance(inp, (tuple, list)):
        return model(*inp)
    return model(inp)


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for a model with neither)."""
    return next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device


def _all_finite(obj: Any) -> torch.Tensor:
    """One bool tensor (no host sync): every floating-point tensor in ``obj`` is finite."""
    return torch.stack([torch.isfinite(t).all() for t in _tensors(obj)] or [torch.tensor(True)]).all()


def _call_stats(ref: list[torch.Tensor], low: list[torch.Tensor], rtol: float, atol: Optional[float]) -> torch.Tensor:
    """One call's comparison as a float64 vector (see the ``_N``... indices).  ``atol=None``
    scales the absolute tolerance with the output: ``rtol * rms(fp32 output)``, so values near
    zero (where a relative error means nothing) are judged against the tensor's size."""
    r = torch.cat([t.detach().reshape(-1).double() for t in ref])
    l = torch.cat([t.detach().reshape(-1).to(r.device).double() for t in low])
    rf, lf = torch.isfinite(r), torch.isfinite(l)
    both = rf & lf
    rz, lz = torch.where(both, r, 0.0), torch.where(both, l, 0.0)
    d = (lz - rz).abs()
    nonzero_ref = both & (rz != 0)
    rel = torch.where(nonzero_ref, d / torch.where(nonzero_ref, rz.abs(), 1.0), 0.0)
    overflow = rf & ~lf
    # Where fp32 itself is inf/NaN the low precision must agree exactly (NaN matches NaN).
    mismatch = ~rf & ~((l == r) | (torch.isnan(l) & torch.isnan(r)))
    if atol is None:
        atol = rtol * (rz * rz).sum().div(both.sum().clamp_min(1)).sqrt()
    viol = (both & (d > atol + rtol * rz.abs())).sum() + overflow.sum() + mismatch.sum()
    zero = d.new_zeros(())
    return torch.stack([
        d.new_full((), float(r.numel())), both.sum().double(), d.sum(),
        d.max() if d.numel() else zero, rel.max() if rel.numel() else zero,
        (rz * lz).sum(), (rz * rz).sum(), (lz * lz).sum(), (d * d).sum(),
        overflow.sum().double(), (nonzero_ref & (lz == 0)).sum().double(), viol.double(), mismatch.sum().double(),
    ])


def _finalize(vecs: list[torch.Tensor]) -> dict:
    """Combine the per-call vectors of one module into the reported numbers."""
    s = torch.stack(vecs).cpu()
    tot = s.sum(0).tolist()
    mx = s.max(0).values.tolist()
    n = max(tot[_N], 1.0)
    broken = tot[_OVF] > 0 or tot[_MISMATCH] > 0
    nref, nlow = math.sqrt(tot[_REF2]), math.sqrt(tot[_LOW2])
    if broken:  # cosine is undefined with inf/NaN in one tensor and not the other
        cosine, rel_err = math.nan, math.inf
    else:  # two zero tensors agree (cosine 1); one zero tensor is orthogonal to anything (0)
        cosine = max(-1.0, min(1.0, tot[_DOT] / (nref * nlow))) if nref and nlow else float(nref == nlow)
        rel_err = math.sqrt(tot[_D2]) / nref if nref else (0.0 if tot[_D2] == 0 else math.inf)
    return {
        "max_abs": math.inf if broken else mx[_MAXABS],
        "max_rel": math.inf if broken else mx[_MAXREL],
        "mean_abs": tot[_SUMABS] / max(tot[_NBOTH], 1.0),
        "cosine": cosine,
        "ok": tot[_VIOL] == 0,
        "overflow_frac": tot[_OVF] / n,
        "underflow_frac": tot[_UNF] / n,
        "rel_err": rel_err,
    }


def _row(name: str, s: dict) -> dict:
    """A report row: ``name`` and the ROW_KEYS of :func:`_finalize`'s numbers."""
    return {k: (name if k == "module" else s[k]) for k in ROW_KEYS}


@dataclass
class LayerwiseReport:
    """Result of :func:`compare_layerwise`.

    rows: one dict per module in execution order with exactly ``ROW_KEYS`` (global error), one
        row per module over all its calls.  Where low precision has inf/NaN and fp32 not:
        max_abs / max_rel are inf, cosine NaN, and overflow_frac counts them; mean_abs is over
        values finite in both; underflow_frac counts values non-zero in fp32 and zero in low.
    details: same order: dtype, calls, rel_err (relative L2), local_max_abs / local_rel_err /
        local_cosine (the module's own error), local_input_ok (False when the fp32 input does not
        fit the low dtype: the error belongs upstream), new_nonfinite.
    grad_rows: with ``backward=True``, the gradient w.r.t. each module's output in backward
        order; param_grad_rows: each module's own parameter grads.
    """

    precision: str
    rtol: Optional[float]
    atol: Optional[float]
    tolerance: str = ""
    rows: list = field(default_factory=list)
    details: list = field(default_factory=list)
    grad_rows: list = field(default_factory=list)
    param_grad_rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def first_bad(self) -> Optional[str]:
        """Name of the first module in execution order whose output is not within tolerance."""
        return next((r["module"] for r in self.rows if not r["ok"]), None)

    @property
    def first_bad_grad(self) -> Optional[str]:
        """First module in backward order whose output gradient is not within tolerance."""
        return next((r["module"] for r in self.grad_rows if not r["ok"]), None)

    def ranked(self) -> list[tuple[dict, dict]]:
        """(row, detail) pairs, worst first: modules that created inf/NaN from finite inputs, then those
        out of tolerance; within each by local (own), then global error; ties keep execution order,
        so the origin of a cascade wins."""
        def key(i: int):
            row, det = self.rows[i], self.details[i]
            local = det["local_rel_err"] if det["local_input_ok"] and det["local_rel_err"] is not None else -1.0
            return (not det["new_nonfinite"], row["ok"], -_sortable(local), -_sortable(det["rel_err"]), i)

        return [(self.rows[i], self.details[i]) for i in sorted(range(len(self.rows)), key=key)]

    def worst(self, n: int = 1) -> list[str]:
        """Names of the ``n`` worst modules."""
        return [r["module"] for r, _ in self.ranked()[:n]]

    def table(self, top: Optional[int] = None) -> str:
        head = f"{'module':<44} {'dtype':>8} {_STATS_HEAD} {'local_err':>9} {'rel_err':>9}  flags"
        lines = [f"layerwise fp32 vs {self.precision} ({self.tolerance or f'rtol={self.rtol}, atol={self.atol}'}); "
                 f"first_bad={self.first_bad}; worst first", head, "-" * len(head)]
        for row, det in self.ranked()[:top]:
            flags = [flag for flag, on in (("CREATES-INF/NAN", det["new_nonfinite"]),
                                           ("input-overflows-dtype", not det["local_input_ok"])) if on]
            local = det["local_rel_err"]
            lines.append(f"{_short(row['module'], 44):<44} {det['dtype']:>8} {_stats(row)} "
                         f"{'—' if local is None else _f(local)} {_f(det['rel_err'])}  {' '.join(flags)}")
        if self.grad_rows:
            lines += ["", f"output gradients (backward order); first_bad_grad={self.first_bad_grad}",
                      f"{'module':<44} {_STATS_HEAD}"]
            lines += [f"{_short(r['module'], 44):<44} {_stats(r)}" for r in self.grad_rows[:top]]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: the worst module and why (or that every module is within tolerance)."""
        if not self.rows:
            return "summary: no module produced a floating-point output to compare"
        row, det = self.ranked()[0]
        bad = sum(not r["ok"] for r in self.rows)
        local = det["local_rel_err"]
        own = "" if local is None else f", its own error {local:.2e} (limit {det['local_tol']:.2e})"
        tol = f"tolerance rtol {det['rtol']:.2e}"
        if det["new_nonfinite"]:
            why = "creates inf/NaN from a finite input (overflow in the low dtype)"
        elif not row["ok"]:
            why = f"out of tolerance: relative error {det['rel_err']:.2e} vs {tol}{own}, cosine {row['cosine']:.5f}"
        else:
            return (f"summary: all {len(self.rows)} modules within tolerance in {self.precision}; the largest "
                    f"error is {row['module'] or '<root>'}: relative {det['rel_err']:.2e} vs {tol}{own}")
        return f"summary: {bad} of {len(self.rows)} modules out of tolerance; worst: {row['module'] or '<root>'}: {why}"

    __str__ = table

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The report as JSON; inf/NaN are written as Infinity/NaN (Python's json reads them back)."""
        summary = {"summary": self.verdict(), "first_bad": self.first_bad, "worst": self.worst(5),
                   "first_bad_grad": self.first_bad_grad}
        return json.dumps({**asdict(self), **summary}, indent=indent)


def _sortable(v: float) -> float:
    return math.inf if v is None or math.isnan(v) else v


_STATS_HEAD = f"{'max_abs':>9} {'max_rel':>9} {'mean_abs':>9} {'cosine':>8} {'ovf%':>6} {'unf%':>6} {'ok':>3}"


def _stats(r: dict) -> str:
    """A row's ROW_KEYS statistics under :data:`_STATS_HEAD`."""
    return (f"{_f(r['max_abs'])} {_f(r['max_rel'])} {_f(r['mean_abs'])} {r['cosine']:8.5f} "
            f"{100 * r['overflow_frac']:6.2f} {100 * r['underflow_frac']:6.2f} {'yes' if r['ok'] else 'NO':>3}")


def _f(v: float) -> str:
    return f"{v:9.2e}" if math.isfinite(v) else f"{str(v):>9}"


def _short(name: str, width: int) -> str:
    name = name or "<root>"
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _watched_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules and modules with parameters of their own (e.g. MultiheadAttention)."""
    return [(name, m) for name, m in model.named_modules()
            if next(m.children(), None) is None or next(m.parameters(recurse=False), None) is not None]


class _Recorder:
    """Hooks of one run: the fp32 one (no ``shadow``) runs first and stores, the low one compares."""

    def __init__(self, model: nn.Module, shadow: Optional["_Recorder"], tol: "Tolerance",
                 local: bool, grads: bool, grad_scale: float):
        self.shadow, self.tol = shadow, tol
        self.depth = 0  # modules with parameters run so far (the low run's depth)
        self.rtols: dict[str, float] = {}
        self.local, self.grads, self.grad_scale = local, grads, grad_scale
        self.calls: dict[str, int] = {}  # in first-call order
        self.inputs: dict[tuple, Any] = {}  # ref: cloned (args, kwargs) per call, for the local re-runs
        self.in_template: dict[tuple, Any] = {}  # low: the call's ((args, kwargs), all finite?) as passed in
        self.outputs: dict[tuple, list] = {}
        self.out_grads: dict[tuple, dict] = {}  # in backward order
        # low, per module and call: comparison, new inf/NaN?, (own-error comparison, fp32 input fits?)
        self.stats, self.new_nonfinite, self.local_stats = defaultdict(list), defaultdict(list), defaultdict(list)
        self.dtypes: dict[str, str] = {}
        self.busy = False  # True while a module is re-run for its local error
        self.handles = []
        for name, m in _watched_modules(model):
            # Prepended: the pre-hook sees what the caller passed, before other pre-hooks (the
            # fp32 policy of *-master norms upcasts half input) change it; the forward hook
            # runs last and sees the final output.
            self.handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True, prepend=True))
            self.handles.append(m.register_forward_hook(self._post(name), with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if self.busy:
                return None
            key = (name, self.calls.get(name, 0))
            if self.shadow is None and self.local:
                # Cloned now: an in-place module (ReLU(inplace=True)) overwrites its input.
                self.inputs[key] = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            if self.shadow is not None:  # only the dtypes are read (for the local cast)
                self.in_template[key] = ((args, kwargs), _all_finite((args, kwargs)))
        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            if self.busy:
                return None
            idx = self.calls.get(name, 0)
            self.calls[name] = idx + 1
            key = (name, idx)
            outs = _tensors(output)
            if not outs:
                return None
            if self.grads:
                self._watch_grad(key, outs)
            if self.shadow is None:
                # Cloned: a later in-place op would change the stored values.
                self.outputs[key] = [t.detach().clone() for t in outs]
                return None
            self.dtypes.setdefault(name, str(outs[0].dtype).replace("torch.", ""))
            if name not in self.rtols:
                self.depth += next(iter(module.parameters(recurse=False)), None) is not None
                self.rtols[name] = self.tol.rtol_at(max(1, self.depth))
            # Popped: each stored fp32 tensor is compared once, then freed (peak memory).
            ref = self.shadow.outputs.pop(key, None)
            if ref is None or [t.shape for t in ref] != [t.shape for t in outs]:
                return None
            self.stats[name].append(_call_stats(ref, outs, self.rtols[name], self.tol.atol))
            low_in, in_finite = self.in_template.pop(key, ((args, kwargs), torch.tensor(True)))
            self.new_nonfinite[name].append(in_finite & ~_all_finite(outs))
            if self.local and key in self.shadow.inputs:
                self._local(module, name, key, low_in, ref)
        return hook

    def _local(self, module, name, key, low_in, ref) -> None:
        ref_in = self.shadow.inputs.pop(key)  # (args, kwargs), like low_in
        cast_args, cast_kwargs = _cast_like(ref_in, low_in)
        # The cast itself may overflow (fp32 value > fp16 max): then the damage is upstream.
        ok_in = _all_finite((cast_args, cast_kwargs)) | ~_all_finite(ref_in)
        self.busy = True
        try:
            with torch.no_grad():
                out = _tensors(module(*cast_args, **cast_kwargs))
        except Exception:  # a module that cannot be re-run alone (stateful, odd signature)
            return
        finally:
            self.busy = False
        if [t.shape for t in out] == [t.shape for t in ref]:
            self.local_stats[name].append((_call_stats(ref, out, self.tol.rtol_at(1), self.tol.atol), ok_in))

    def _watch_grad(self, key, outs) -> None:
        for i, t in enumerate(outs):
            if t.requires_grad:
                def grab(g, key=key, i=i):
                    self.out_grads.setdefault(key, {})[i] = g.detach().float() / self.grad_scale
                t.register_hook(grab)


def _projection_loss(out: Any, seed: int = 1234) -> torch.Tensor:
    """sum(out_i * r_i) with fixed random r: every output element gets a distinct, O(1) gradient."""
    outs = _tensors(out)
    if not outs:
        raise ValueError("compare_layerwise(backward=True): the model output has no floating-point tensor "
                         "to differentiate")
    gen = torch.Generator().manual_seed(seed)
    return sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in outs)


@contextlib.contextmanager
def _strict_fp32():
    """fp32 math really in fp32 while the comparison runs (restored on exit): CUDA convolutions
    default to TF32, a 10-bit mantissa as coarse as fp16's, which the fp32 shadow must not carry."""
    matmul = torch.get_float32_matmul_precision()
    # torch >= 2.9 has per-op fp32_precision (mixing it with the legacy allow_tf32 flag raises
    # on read); before, allow_tf32 is the only switch.  conv and rnn together keep them consistent.
    ops = [getattr(torch.backends.cudnn, op, None) for op in ("conv", "rnn")]
    if all(hasattr(o, "fp32_precision") for o in ops):
        changes = [(o, "fp32_precision", "ieee") for o in ops]
    else:
        changes = [(torch.backends.cudnn, "allow_tf32", False)]
    saved = [getattr(o, attr) for o, attr, _ in changes]
    torch.set_float32_matmul_precision("highest")
    try:
        for o, attr, value in changes:
            setattr(o, attr, value)
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        for (o, attr, _), value in zip(changes, saved):
            setattr(o, attr, value)


def _resolve_precision(precision, device):
    if not isinstance(precision, str):
        return precision  # a Precision object
    from mptrain.precision import PRECISIONS, build_precision, normalize_precision

    try:
        name = normalize_precision(precision)  # Lightning's aliases ("bf16", "16") included
    except ValueError:
        raise ValueError(f"compare_layerwise: precision={precision!r} is not one of {tuple(PRECISIONS)}") from None
    return build_precision(name, device=device)


def compare_layerwise(model: nn.Module, example_input: Any, precision: Any = "bf16-mixed", rtol: Optional[float] = None,
                      atol: Optional[float] = None, backward: bool = False, local: bool = True, train_mode: bool = False,
                      loss_fn: Optional[Callable[[Any], torch.Tensor]] = None, loss_scale: float = 1.0) -> LayerwiseReport:
    """Compare every module of ``model`` run in ``precision`` against an fp32 copy.

    Args:
        model: left untouched; two deep copies are made on its device.
        example_input: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        precision: a string of ``mptrain.PRECISIONS`` or a Precision object.
        rtol, atol: a module is ``ok`` when every output element satisfies ``|low - fp32| <= atol
            + rtol * |fp32|`` and it has inf/NaN only where fp32 has them.  ``None`` (default):
            from the low dtype's rounding and the module's depth (see :class:`Tolerance`).
        backward: also compare gradients (w.r.t. each module's output and its parameters)
            of ``loss_fn(output)`` -- by default a fixed random projection of the outputs.
        local: also measure each module's own error on its fp32 input (ranks the table).
        train_mode: keep training mode (BatchNorm batch statistics; dropout masks differ between
            the copies: set dropout to 0); by default both copies are in eval mode.
        loss_scale: multiplies the low-precision loss before backward; the gradients are divided
            by it (what a loss scaler does for fp16).
    """
    device = _model_device(model)
    prec = _resolve_precision(precision, device)
    ref_model = copy.deepcopy(model).float().train(train_mode)
    low_model = copy.deepcopy(model).float().train(train_mode)
    low_model = prec.convert_module(low_model) or low_model
    ref_in = tree_map_only(torch.Tensor, lambda t: t.to(device, torch.float32 if t.is_floating_point() else t.dtype),
                           example_input)
    low_in = prec.convert_input(tree_map_only(torch.Tensor, lambda t: t.to(device), example_input))

    name = getattr(prec, "precision", None) or getattr(prec, "name", None) or str(precision)
    tol = Tolerance(_unit_roundoff(str(name)), rtol=rtol, atol=atol)
    ref_rec = _Recorder(ref_model, None, tol, local, backward, 1.0)
    low_rec = _Recorder(low_model, ref_rec, tol, local, backward, loss_scale)
    loss_fn = loss_fn or _projection_loss
    try:
        with torch.set_grad_enabled(backward), _strict_fp32():
            ref_out = _call(ref_model, ref_in)
            if backward:
                loss_fn(ref_out).backward()
            with prec.forward_context():
                low_out = _call(low_model, low_in)
            if backward:
                (loss_fn(low_out) * loss_scale).backward()
    finally:
        ref_rec.remove()
        low_rec.remove()
    report = LayerwiseReport(str(name), rtol, atol, tol.describe())
    _fill_forward(report, ref_rec, low_rec, tol)
    if backward:  # gradients went back through every layer: the tolerance of the full depth
        _fill_grads(report, ref_rec, low_rec, ref_model, low_model, loss_scale,
                    tol.rtol_at(max(1, low_rec.depth)), tol.atol)
    return report


def _fill_forward(report: LayerwiseReport, ref_rec: _Recorder, low_rec: _Recorder, tol: Tolerance) -> None:
    unmatched = [n for n in ref_rec.calls if n not in low_rec.stats and (n, 0) in ref_rec.outputs]
    if unmatched:
        report.notes.append(f"{len(unmatched)} module(s) had no matching low-precision output: {unmatched[:5]}")
    for name in [n for n in ref_rec.calls if n in low_rec.stats]:
        s = _finalize(low_rec.stats[name])
        row = _row(name, s)
        det = {"module": name, "dtype": low_rec.dtypes[name], "calls": len(low_rec.stats[name]),
               "rel_err": s["rel_err"], "rtol": low_rec.rtols[name],
               "new_nonfinite": any(bool(t) for t in low_rec.new_nonfinite[name]), "local_max_abs": None,
               "local_rel_err": None, "local_cosine": None, "local_ok": None, "local_input_ok": True}
        if name in low_rec.local_stats:
            ls = _finalize([v for v, _ in low_rec.local_stats[name]])
            input_ok = all(bool(ok) for _, ok in low_rec.local_stats[name])
            own_ok = not input_ok or ls["rel_err"] <= tol.local_limit()
            det.update(local_max_abs=ls["max_abs"], local_rel_err=ls["rel_err"], local_cosine=ls["cosine"],
                       local_ok=ls["ok"] and own_ok, local_input_ok=input_ok, local_tol=tol.local_limit())
            row["ok"] = row["ok"] and own_ok
        report.rows.append(row)
        report.details.append(det)


def _fill_grads(report, ref_rec, low_rec, ref_model, low_model, loss_scale, rtol: float, atol: Optional[float]) -> None:
    per_module = defaultdict(list)
    for key, low_g in low_rec.out_grads.items():
        ref_g = ref_rec.out_grads.get(key, {})
        idx = sorted(ref_g)
        if not idx or idx != sorted(low_g) or [ref_g[i].shape for i in idx] != [low_g[i].shape for i in idx]:
            continue
        per_module[key[0]].append(_call_stats([ref_g[i] for i in idx], [low_g[i] for i in idx], rtol, atol))
    # insertion order = backward execution order
    report.grad_rows += [_row(name, _finalize(vecs)) for name, vecs in per_module.items()]
    low_mods = dict(low_model.named_modules())
    for name, ref_m in ref_model.named_modules():
        low_params = dict(low_mods[name].named_parameters(recurse=False)) if name in low_mods else {}
        pairs = [(p.grad, low_params[n].grad) for n, p in ref_m.named_parameters(recurse=False)
                 if p.grad is not None and n in low_params and low_params[n].grad is not None]
        if not pairs:
            continue
        s = _finalize([_call_stats([a for a, _ in pairs], [b.float() / loss_scale for _, b in pairs], rtol, atol)])
        report.param_grad_rows.append(_row(name, s))
