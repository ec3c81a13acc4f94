"""What fp8 training does to each linear layer's GEMM operands: :func:`fp8_report`.

``fp8-master`` quantizes, in each linear layer, the input ``x`` and the weight ``W`` (e4m3) and the output
gradient ``dY`` (e5m2 with ``tensorwise``, e4m3 with ``rowwise``) with a scale computed from the operand's
amax (``scale = fmax / amax``, per tensor or per row; ``rowwise`` rounds the scales down to powers of 2).
This tool runs the model in its own precision (fp32 or bf16; no fp8 GEMM, so it works on the CPU), records
those operands with hooks on every ``nn.Linear`` (torchao's ``Float8Linear`` included) and measures, for
each cast the recipe makes (torchao's own configuration: the same scales, dtypes and axes), what the cast
does: the fraction of values that saturate, that underflow to zero or to fp8 subnormals, and the relative
error of the dequantized tensor, plus each step's scale.  A layer whose operand has a dynamic range wider
than the fp8 format (e4m3 spans 448 / 2^-9, about 2^17.8) loses its small values: the report ranks it first
and says to keep it in bf16.  A uniform rescaling of an operand changes nothing under current scaling (the
scale follows the amax): only the spread of magnitudes within what one scale covers matters.
"""
from __future__ import annotations

import itertools
import json
import math
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from mptrain.numerics.layerwise import _call, _model_device, _short
from mptrain.precision.fp8 import RECIPES, _torchao_float8, is_float8_linear
from mptrain.precision.fp8_delayed import HISTORY as DELAYED_HISTORY
from mptrain.precision.fp8_policy import plan_fp8_layers, resolve_keep_list
from mptrain.precision.list_grammar import is_edit_list

#: keys of each operand entry (one per distinct cast the recipe makes of the operand)
CAST_KEYS = ("operand", "format", "scaling", "gemms", "scale", "scale_history", "amax", "saturated_frac",
             "underflow_frac", "subnormal_frac", "nonfinite_frac", "rel_err", "over")
#: keys of each layer
LAYER_KEYS = ("layer", "shape", "fp8_master", "calls", "score", "flags", "advice", "casts")
#: keys of the whole report (``Fp8Report.to_dict()``)
REPORT_KEYS = ("recipe", "scaling", "amax_history_len", "steps", "thresholds", "layers", "keep_bf16", "summary")

FORMAT_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
SCALINGS = ("current", "delayed")
#: defaults: flag a layer when more than 1% of an operand's non-zero values flush to zero, more than 0.1%
#: saturate, or the dequantized operand's relative L2 error exceeds the format's unit roundoff (e4m3 2^-4,
#: e5m2 2^-3: a well-scaled Gaussian tensor measures about 0.42 of it, 0.026 in e4m3)
UNDERFLOW_THRESHOLD = 0.01
SATURATION_THRESHOLD = 1e-3
DEFAULT_REL_ERR = {name: torch.finfo(dtype).eps / 2 for dtype, name in FORMAT_NAMES.items()}

# Index of each count in a cast's per-call statistics vector (summed over calls).
_NZ, _NONFINITE, _N, _SAT, _UNDER, _SUB, _D2, _X2 = range(8)


@dataclass(frozen=True)
class Cast:
    """One quantization the recipe makes of one GEMM operand.

    ``axis`` is None for one scale per tensor, -1 for one scale per row of the 2-D operand (its reduction
    runs along the row), 0 for one per column.  Rows of ``x`` and ``dY`` are tokens, rows of ``W`` output
    features.  ``gemms`` are the GEMMs that consume it (``output``, ``grad_input``, ``grad_weight``)."""

    operand: str
    dtype: torch.dtype
    axis: Optional[int]
    pow2: bool
    gemms: tuple[str, ...]

    @property
    def scaling(self) -> str:
        kind = {None: "tensor", -1: "row", 0: "column"}[self.axis]
        return f"{kind}/pow2" if self.pow2 else kind

    @property
    def key(self) -> str:
        return self.operand if self.axis is None else f"{self.operand}.{'row' if self.axis == -1 else 'col'}"


def recipe_casts(recipe: str) -> list[Cast]:
    """The casts ``fp8-master`` makes with ``recipe``, read from torchao's ``Float8LinearConfig``.

    In each GEMM torchao casts the 2-D operands along the reduction dimension: ``output = x @ W^T`` (x per row,
    W per row), ``grad_input = dY @ W`` (dY per row, W per column), ``grad_weight = dY^T @ x`` (both per
    column).  Tensorwise casts of one operand are identical whatever the GEMM: they are listed once, and fp8-master
    makes them once (:class:`~mptrain.precision.fp8_linear.Fp8Linear`)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not an fp8-master recipe. "
                         f"Valid values: {', '.join(map(repr, RECIPES))}")
    float8 = _torchao_float8()
    from torchao.float8.config import ScalingGranularity, ScalingType

    cfg = float8.Float8LinearConfig.from_recipe_name(RECIPES[recipe])
    uses = [("x", "output", cfg.cast_config_input, -1), ("w", "output", cfg.cast_config_weight, -1),
            ("dy", "grad_input", cfg.cast_config_grad_output, -1),
            ("w", "grad_input", cfg.cast_config_weight_for_grad_input, 0),
            ("dy", "grad_weight", cfg.cast_config_grad_output_for_grad_weight, 0),
            ("x", "grad_weight", cfg.cast_config_input_for_grad_weight, 0)]
    casts: dict[tuple, list[str]] = {}
    for operand, gemm, cc, axis in uses:
        if cc.scaling_type is ScalingType.DISABLED:
            continue  # that GEMM runs in high precision
        tensorwise = cc.scaling_granularity is ScalingGranularity.TENSORWISE
        casts.setdefault((operand, cc.target_dtype, None if tensorwise else axis), []).append(gemm)
    pow2 = bool(cfg.round_scales_to_power_of_2)
    order, axes = {"x": 0, "w": 1, "dy": 2}, {None: 0, -1: 1, 0: 2}
    return sorted((Cast(op, dt, ax, pow2, tuple(g)) for (op, dt, ax), g in casts.items()),
                  key=lambda c: (order[c.operand], axes[c.axis]))


def cast_scale(t: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, scale) of the 2-D tensor ``t`` as torchao computes them (current scaling), keepdim per axis."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    granularity = ScalingGranularity.TENSORWISE if cast.axis is None else ScalingGranularity.AXISWISE
    amax = tensor_to_amax(t, scaling_granularity=granularity, axiswise_dim=cast.axis)
    return amax, amax_to_scale(amax, cast.dtype, round_scales_to_power_of_2=cast.pow2)


def cast_stats(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What casting ``t * scale`` to the fp8 ``dtype`` (torchao's saturated cast) does, as a float64 vector
    indexed by ``_NZ``...: counts of non-zero finite, non-finite, all, saturated (the scaled value rounds
    beyond fmax, so the clamp decides it), flushed to zero, landing on a subnormal; and the squared L2 norms
    of the dequantization error and of ``t`` over its finite values."""
    from torchao.float8.float8_utils import to_fp8_saturated

    info = torch.finfo(dtype)
    x = t.detach().float()
    scaled = x * scale
    q = to_fp8_saturated(scaled, dtype).float()
    finite = torch.isfinite(x)
    nonzero = finite & (x != 0)
    # Rounding to nearest reaches fmax up to half an ulp above it; beyond that only the clamp gives fmax.
    half_ulp = 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
    saturated = finite & (scaled.abs() > info.max + half_ulp)
    d = torch.where(finite, torch.where(q == 0, 0.0, q / scale) - x, 0.0)  # a scale of 0 (inf amax) gives 0
    xf = torch.where(finite, x, 0.0)
    counts = [nonzero.sum(), (~finite).sum(), saturated.sum(), (nonzero & (q == 0)).sum(),
              (nonzero & (q != 0) & (q.abs() < info.tiny)).sum()]
    counts.insert(_N, x.new_full((), x.numel(), dtype=torch.float64))  # no host-to-device copy
    norms = [(d * d).sum(dtype=torch.float64), (xf * xf).sum(dtype=torch.float64)]
    return torch.stack([c.double() for c in counts] + norms)


class _CastRecord:
    """One layer's measurements of one :class:`Cast`: statistics summed over calls, the scales of each step."""

    def __init__(self, cast: Cast, history_len: Optional[int]):
        self.cast = cast
        self.stats: Optional[torch.Tensor] = None
        self.step_scales: list[torch.Tensor] = []
        self.step_amax: list[torch.Tensor] = []
        self.scale_history: list[Optional[torch.Tensor]] = []  # per step: [min, median, max] of its scales
        self.amax_history: list[Optional[torch.Tensor]] = []
        # delayed scaling: the amax of the previous calls (None: current scaling)
        self.past_amax: Optional[deque] = None if history_len is None else deque(maxlen=history_len)

    def observe(self, t: torch.Tensor) -> None:
        amax, scale = cast_scale(t, self.cast)
        if self.past_amax is not None:
            if self.past_amax:  # the first call has no history: it uses its own amax
                from torchao.float8.float8_utils import amax_to_scale

                scale = amax_to_scale(torch.stack(list(self.past_amax)).max(), self.cast.dtype, self.cast.pow2)
            self.past_amax.append(amax.reshape(()))
        v = cast_stats(t, scale, self.cast.dtype)
        self.stats = v if self.stats is None else self.stats + v
        self.step_scales.append(scale.reshape(-1).float())
        self.step_amax.append(amax.max().float())

    def end_step(self) -> None:
        if self.step_scales:
            s = torch.cat(self.step_scales)
            self.scale_history.append(torch.stack([s.min(), s.median(), s.max()]))
            self.amax_history.append(torch.stack(self.step_amax).max())
        else:  # the layer did not run (or got no gradient) in this step
            self.scale_history.append(None)
            self.amax_history.append(None)
        self.step_scales, self.step_amax = [], []

    def result(self) -> dict:
        """The cast's entry (``CAST_KEYS`` but ``over``, which the layer adds); the fractions are over the
        operand's non-zero finite values (``nonfinite_frac`` over all), ``rel_err`` is ``||q/scale - x|| / ||x||``
        over all calls."""
        c = self.cast
        st = [0.0] * 8 if self.stats is None else self.stats.cpu().tolist()
        nz = max(st[_NZ], 1.0)
        ran = [h for h in self.scale_history if h is not None]
        values = iter(torch.stack(ran).cpu().tolist() if ran else [])  # one host transfer
        history = [None if h is None else _scale_item(next(values), c) for h in self.scale_history]
        amax = next((a.item() for a in reversed(self.amax_history) if a is not None), None)
        return {"operand": c.key, "format": FORMAT_NAMES[c.dtype], "scaling": c.scaling, "gemms": list(c.gemms),
                "scale": next((h for h in reversed(history) if h is not None), None), "scale_history": history,
                "amax": amax, "saturated_frac": st[_SAT] / nz, "underflow_frac": st[_UNDER] / nz,
                "subnormal_frac": st[_SUB] / nz, "nonfinite_frac": st[_NONFINITE] / max(st[_N], 1.0),
                "rel_err": math.sqrt(st[_D2] / st[_X2]) if st[_X2] > 0 else 0.0}


def _scale_item(summary: list[float], cast: Cast) -> Union[float, dict]:
    """A step's scale as reported: one number for a tensorwise cast (the smallest when the layer ran several
    times in the step), else the min, median and max over its rows or columns."""
    return summary[0] if cast.axis is None else dict(zip(("min", "median", "max"), summary))


class _LayerRecord:
    """Hooks of one linear layer: ``x`` and ``W`` when it runs, ``dY`` when its output's gradient arrives."""

    def __init__(self, name: str, module: nn.Linear, casts: list[Cast], history_len: Optional[int],
                 current: tuple[str, ...] = ()):
        self.name, self.module, self.calls = name, module, 0
        self.casts = [_CastRecord(c, None if c.operand in current else history_len) for c in casts]

    def operands(self, operand: str) -> list[_CastRecord]:
        return [r for r in self.casts if r.cast.operand == operand]

    def forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return
        self.calls += 1
        with torch.no_grad():
            for r in self.operands("x"):
                r.observe(x.detach().reshape(-1, x.shape[-1]))
            for r in self.operands("w"):
                r.observe(module.weight.detach())
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # A tensor hook, not a full backward hook: those wrap the output in a view that an in-place
            # successor (Linear -> ReLU(inplace=True)) may not modify.  It sees the gradient of the output
            # the layer returned, before any in-place change.
            output.register_hook(self.grad_hook)

    def grad_hook(self, grad: torch.Tensor) -> None:
        if grad.numel():
            with torch.no_grad():
                for r in self.operands("dy"):
                    r.observe(grad.detach().reshape(-1, grad.shape[-1]))

    def end_step(self) -> None:
        for r in self.casts:
            r.end_step()


def fp8_report(model: nn.Module, batches: Iterable[Any], *, steps: Optional[int] = None,
               loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
               optimizer: Optional[torch.optim.Optimizer] = None, recipe: str = "tensorwise",
               scaling: Optional[str] = None, amax_history_len: int = 16,
               keep_bf16: Union[str, Iterable[str], None] = "default",
               underflow_threshold: float = UNDERFLOW_THRESHOLD, saturation_threshold: float = SATURATION_THRESHOLD,
               rel_err_threshold: Optional[float] = None) -> "Fp8Report":
    """Measure what ``fp8-master``'s casts do to every linear layer's operands over training steps.

    Each step takes one batch (moved to the model's device), computes the loss (``loss_fn(model, batch)``;
    else a LightningModule's ``training_step(batch, i)``; else the model's output's ``loss`` or the output
    itself when it is a scalar) and runs the backward pass, then ``optimizer.step()`` when an optimizer is
    given.  Without one the weights do not change, and the parameters' ``.grad`` are restored at the end.
    The model runs in training mode (restored at the end) in its own dtype.

    Args:
        batches: an iterable of batches (a DataLoader, a list); ``steps`` caps how many are used.
        recipe: ``"tensorwise"``, ``"delayed"`` or ``"rowwise"``, as ``Fp8Precision(recipe=...)``; ``"delayed"``
            measures what that recipe casts: ``x`` and ``dY`` with delayed scales over its history
            (``scaling`` and ``amax_history_len`` are then its own), ``W`` at current scale.
        scaling: ``"current"`` (the default but with ``recipe="delayed"``: the scale of each cast from its own
            amax, what fp8-master's ``tensorwise`` and ``rowwise`` do) or
            ``"delayed"`` (tensorwise only: from the largest amax of the previous ``amax_history_len`` calls,
            Transformer Engine's classic recipe; the first call uses its own).  Delayed scales lag a growing
            tensor: that is where saturation shows.
        keep_bf16: the policy fp8-master would use (``Fp8Precision(keep_bf16=...)``): the report says which
            layers it converts and writes its advice as an edit of this value.
        underflow_threshold / saturation_threshold: flag a layer when an operand's fraction of non-zero values
            flushed to zero / saturated exceeds this; ``rel_err_threshold``: when the relative L2 error of a
            dequantized operand exceeds this (default: the format's unit roundoff, e4m3 2^-4, e5m2 2^-3).
    """
    if scaling is not None and scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not supported. Valid values: {', '.join(map(repr, SCALINGS))}")
    current: tuple[str, ...] = ()
    if recipe == "delayed":  # fp8-master's delayed recipe: x and dY from their history, W at its own amax
        if scaling == "current" or amax_history_len != DELAYED_HISTORY:
            raise ValueError(f"recipe='delayed' is fp8-master's delayed recipe (delayed scales over "
                             f"{DELAYED_HISTORY} steps); scaling={scaling!r}, amax_history_len={amax_history_len} "
                             f"differ from it. Leave them unset, or use recipe='tensorwise' with them")
        scaling, current = "delayed", ("w",)
    scaling = scaling or "current"
    casts = recipe_casts(recipe)
    if scaling == "delayed" and any(c.axis is not None for c in casts):
        raise ValueError(f"scaling='delayed' keeps one amax history per tensor; recipe={recipe!r} scales per row. "
                         f"Use recipe='tensorwise' with scaling='delayed'")
    _check_args(steps=(steps, 1), amax_history_len=(amax_history_len, 1), underflow_threshold=(underflow_threshold, 0),
                saturation_threshold=(saturation_threshold, 0), rel_err_threshold=(rel_err_threshold, 0))
    if keep_bf16 is not None and not isinstance(keep_bf16, str):
        keep_bf16 = list(keep_bf16)
    keep = resolve_keep_list(keep_bf16)
    records = [_LayerRecord(name, m, casts, amax_history_len if scaling == "delayed" else None, current)
               for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not records:
        raise ValueError(f"fp8_report: {type(model).__name__} has no nn.Linear layer: fp8-master converts only those")
    status = _fp8_master_status(model, keep)
    n_steps = _run_steps(model, batches, records, steps, loss_fn, optimizer)
    thresholds = {"underflow_frac": underflow_threshold, "saturated_frac": saturation_threshold,
                  "rel_err": rel_err_threshold if rel_err_threshold is not None else dict(DEFAULT_REL_ERR)}
    layers = [_layer_result(r, status[r.name], thresholds, keep_bf16) for r in records]
    order = sorted(range(len(layers)), key=lambda i: (-layers[i]["score"], i))
    advice = _keep_advice(keep_bf16, [layers[i]["layer"] for i in order
                                      if layers[i]["flags"] and layers[i]["fp8_master"].startswith("fp8")])
    return Fp8Report(recipe=recipe, scaling=scaling,
                     amax_history_len=amax_history_len if scaling == "delayed" else None, steps=n_steps,
                     thresholds=thresholds, layers=[layers[i] for i in order], keep_bf16=advice)


def _check_args(**checks: tuple) -> None:
    for name, (value, low) in checks.items():
        if value is not None and not value >= low:
            raise ValueError(f"fp8_report({name}={value!r}): must be >= {low}")


def _fp8_master_status(model: nn.Module, keep: tuple[str, ...]) -> dict[str, str]:
    """Per linear layer: ``"fp8"`` when fp8-master with this keep list converts it, else ``"kept: <why>"``."""
    convert, kept = plan_fp8_layers(model, keep)
    status = {**{n: "fp8" for n in convert}, **{n: f"kept: {why}" for n, why in kept.items()}}
    status.update({n: "fp8: already a Float8Linear" for n, m in model.named_modules() if is_float8_linear(m)})
    return status


def _run_steps(model: nn.Module, batches: Iterable[Any], records: list[_LayerRecord], steps: Optional[int],
               loss_fn: Optional[Callable], optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Forward, backward (and optimizer step) per batch with the layers' hooks on; the number of steps run.
    Training mode, the hooks and, without an optimizer, the parameters' gradients are restored at the end."""
    device = _model_device(model)
    modes = {m: m.training for m in model.modules()}
    grads = None if optimizer is not None else {p: p.grad for p in model.parameters()}
    handles = [r.module.register_forward_hook(r.forward_hook, with_kwargs=True) for r in records]
    n = 0
    try:
        model.train()
        with torch.enable_grad():
            for step, batch in enumerate(itertools.islice(batches, steps)):
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                _loss(model, move_data_to_device(batch, device), step, loss_fn).backward()
                if optimizer is not None:
                    optimizer.step()
                for r in records:
                    r.end_step()
                n += 1
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
        for p, g in (grads or {}).items():
            p.grad = g
    if n == 0:
        raise ValueError("fp8_report: `batches` gave no batch")
    return n


def _loss(model: nn.Module, batch: Any, step: int, loss_fn: Optional[Callable]) -> torch.Tensor:
    if loss_fn is not None:
        out = loss_fn(model, batch)
    elif isinstance(model, pl.LightningModule) and type(model).training_step is not pl.LightningModule.training_step:
        with warnings.catch_warnings():  # its self.log() calls without a Trainer are no-ops
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            out = model.training_step(batch, step)
    else:
        out = _call(model, batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        what = f"a {type(out).__name__}" + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
        raise TypeError(f"fp8_report needs a scalar loss that requires grad for the backward pass; "
                        f"{type(model).__name__} gave {what}. Pass loss_fn=lambda model, batch: <scalar loss>")
    return loss


_METRICS = (("underflow_frac", "underflow"), ("saturated_frac", "saturation"), ("rel_err", "rel_err"))


def _layer_result(record: _LayerRecord, status: str, thresholds: dict, keep_bf16: Any) -> dict:
    """A layer's entry (``LAYER_KEYS``).  ``score``: the largest ratio of an operand's underflow, saturation
    or error to its threshold (> 1: flagged); ``flags`` name each excess."""
    casts = [r.result() for r in record.casts]
    score, flags = 0.0, []
    for c in casts:
        c["over"] = []
        for key, label in _METRICS:
            limit = thresholds[key][c["format"]] if isinstance(thresholds[key], dict) else thresholds[key]
            value = c[key]
            ratio = value / limit if limit > 0 else (math.inf if value > 0 else 0.0)
            score = max(score, ratio)
            if ratio > 1:
                c["over"].append(label)
                shown = (f"{100 * value:.3g}% > {100 * limit:.3g}%" if key != "rel_err"
                         else f"{value:.3g} > {limit:.3g}")
                flags.append(f"{c['operand']} {label} {shown}")
    return {"layer": record.name, "shape": list(record.module.weight.shape), "fp8_master": status,
            "calls": record.calls, "score": score, "flags": flags,
            "advice": _layer_advice(record.name, status, keep_bf16) if flags else None, "casts": casts}


def _layer_advice(name: str, status: str, keep_bf16: Any) -> str:
    if not status.startswith("fp8"):
        return f"keep in bf16 (fp8-master keeps it already: {status[len('kept: '):]})"
    if not name:
        return "keep in bf16: the model is this one linear layer: train it with 'bf16-master'"
    # the summary's keep_bf16 adds every flagged layer to the user's value
    if _edits(keep_bf16):
        return f"keep in bf16: keep_bf16={[f'+{name}']!r}"
    return f"keep in bf16: add {name!r} to keep_bf16"


def _edits(keep_bf16: Any) -> bool:
    """Is ``keep_bf16`` the default list or edits of it (``+x`` / ``-x``), rather than a whole list?"""
    return keep_bf16 is None or isinstance(keep_bf16, str) or is_edit_list(keep_bf16)


def _keep_advice(keep_bf16: Any, names: list[str]) -> Optional[list[str]]:
    """The ``keep_bf16`` value that keeps ``names`` in bf16 too: the user's value plus those layers (None: no
    layer to add)."""
    names = [n for n in names if n]
    if not names:
        return None
    if keep_bf16 is None or isinstance(keep_bf16, str):
        return [f"+{n}" for n in names]
    return list(keep_bf16) + ([f"+{n}" for n in names] if _edits(keep_bf16) else names)


@dataclass
class Fp8Report:
    """Result of :func:`fp8_report`: ``layers`` worst first (``LAYER_KEYS``, each with its ``casts``:
    ``CAST_KEYS``); ``keep_bf16``: the ``Fp8Precision(keep_bf16=...)`` value that also keeps every flagged
    layer fp8-master would convert (None: nothing to change)."""

    recipe: str
    scaling: str
    amax_history_len: Optional[int]
    steps: int
    thresholds: dict
    layers: list = field(default_factory=list)
    keep_bf16: Optional[list] = None

    def flagged(self) -> list[str]:
        """Names of the layers over a threshold, worst first."""
        return [la["layer"] for la in self.layers if la["flags"]]

    def summary(self) -> str:
        """One line: how many layers are over the thresholds, the worst one and why, and the advice."""
        n, bad = len(self.layers), self.flagged()
        worst = self.layers[0]
        if not bad:
            return (f"summary: all {n} linear layers within the thresholds in fp8 ({self.recipe}, {self.scaling} "
                    f"scaling); the closest is {_short(worst['layer'], 60)} at {worst['score']:.2f} of a threshold")
        advice = f"; keep_bf16={self.keep_bf16!r}" if self.keep_bf16 else "; fp8-master keeps them in bf16 already"
        return (f"summary: {len(bad)} of {n} linear layers over the thresholds; worst: {_short(worst['layer'], 60)}: "
                f"{', '.join(worst['flags'])}{advice}")

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, top: Optional[int] = None) -> str:
        """The report as text, worst layer first, one line per cast; flagged layers end with their advice."""
        thr = self.thresholds
        rel = thr["rel_err"] if not isinstance(thr["rel_err"], dict) else \
            "/".join(f"{k} {v:.3g}" for k, v in thr["rel_err"].items())
        delayed = f", amax history {self.amax_history_len}" if self.amax_history_len else ""
        head = (f"{'layer':<32} {'fp8-master':<10} {'operand':<7} {'fmt':<4} {'scaling':<12} {'scale':>26} "
                f"{'amax':>8} {'sat%':>6} {'unf%':>6} {'sub%':>6} {'rel_err':>8}  over")
        lines = [f"fp8 casts per linear layer: recipe {self.recipe} ({self.scaling} scaling{delayed}), {self.steps} "
                 f"steps; thresholds: underflow {100 * thr['underflow_frac']:.3g}%, saturation "
                 f"{100 * thr['saturated_frac']:.3g}%, rel_err {rel}; worst layer first", head, "-" * len(head)]
        for la in self.layers[:top]:
            for i, c in enumerate(la["casts"]):
                name, status = (_short(la["layer"], 32), la["fp8_master"].split(":")[0]) if i == 0 else ("", "")
                lines.append(f"{name:<32} {status:<10} {c['operand']:<7} {c['format']:<4} {c['scaling']:<12} "
                             f"{_scale_text(c['scale']):>26} {_num(c['amax']):>8} {_pct(c['saturated_frac'])} "
                             f"{_pct(c['underflow_frac'])} {_pct(c['subnormal_frac'])} {c['rel_err']:8.2e}  "
                             f"{' '.join(c['over'])}")
            if la["advice"]:
                lines.append(f"  -> {la['advice']}")
            if any(c["nonfinite_frac"] for c in la["casts"]):
                lines.append("  note: inf/NaN in an operand of the high-precision run itself (an overflow, not fp8's)")
        lines.append(self.summary())
        return "\n".join(lines)

    __str__ = table


def _scale_text(scale: Union[None, float, dict]) -> str:
    if scale is None:
        return "—"
    if isinstance(scale, dict):
        return "/".join(_num(scale[k]) for k in ("min", "median", "max"))
    return _num(scale)


def _num(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2e}" if math.isfinite(v) else str(v)


def _pct(frac: float) -> str:
    return f"{100 * frac:6.2f}"
