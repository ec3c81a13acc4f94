"""LayerNorm / RMSNorm benchmark cases (issue 3): fused kernel vs torch eager.

Floor (DESIGN §5): forward reads x and writes y (4 B/elem in bf16), backward reads x
and dy and writes dx (6 B/elem): 10 B/elem for fwd+bwd (the params, the fp32 mean/rstd
and the dgamma/dbeta partials are small and not counted).
Timing: both sides as GPU work, several steps captured in one CUDA graph
(mptrain/bench/graph_timing.py).

Rows, per shape:
* ``fwd+bwd`` (the issue's target): ours under every launch variant (below), torch once.
* ``fwd`` alone and ``bwd`` alone (bf16-weight LayerNorm): each kernel against its own
  floor, so the fwd+bwd time can be split; ``bwd`` calls the backward ops directly
  (ours and aten's) on the saved statistics of one forward per input set.
Launch variants (csrc/layer_norm.cu reads them on every call): $MPT_LN_FWD (auto | r1:
rows per warp), $MPT_LN_BWD (auto | b256 | b512 | coop | split4), $MPT_LN_PDL (0 | 1,
programmatic dependent launch), $MPT_LN_FINISH (auto | 8 | 32: column tile of the
dgamma / dbeta finish kernel), $MPT_LN_FOLD (1 | 0: split4 finishes dgamma / dbeta itself,
or leaves it to the finish kernel).  The default (auto / auto / 1 / auto / 1; auto's
forward takes 2 rows per warp and its backward is split4 at rows <= 1024 bf16) keeps the
plain row name; other rows name the settings that differ.

``MPT_BENCH_NORM=split`` (quick round): the default backward (split4 at these shapes)
against run 5's table (b256, b512), as bwd-only and fwd+bwd rows at 16384x1024 and
65536x768 (~15 s).  ``MPT_BENCH_NORM=fold`` (run 8's quick round): the in-kernel finish
against the finish kernel (MPT_LN_FOLD=0), bwd and fwd+bwd rows at the three target shapes.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.common import Result, Rotating, floor_ms, sets_for
from mptrain.bench.graph_timing import env_var, step_ms

# (rows, hidden) from the target table; all bf16.
CASES = [(16384, 1024), (16384, 4096), (65536, 768)]
QUICK_CASES = [(16384, 1024)]
FWD_ENV, BWD_ENV, PDL_ENV, FIN_ENV = "MPT_LN_FWD", "MPT_LN_BWD", "MPT_LN_PDL", "MPT_LN_FINISH"
FOLD_ENV = "MPT_LN_FOLD"
# PDL on by default since run 5; 2 rows per warp (fwd) and the finish tile by width since run 7;
# dgamma / dbeta finished inside the split4 backward since run 8.
DEFAULTS = {FWD_ENV: "auto", BWD_ENV: "auto", PDL_ENV: "1", FIN_ENV: "auto", FOLD_ENV: "1"}
# fwd+bwd variants for the bf16-weight LayerNorm rows (the table), default first.
FULL_VARIANTS = [
    {},
    {BWD_ENV: "b256"},
    {BWD_ENV: "b512"},
    {BWD_ENV: "coop"},
    {PDL_ENV: "0"},
    {FWD_ENV: "r1"},
    {FIN_ENV: "8"},
    {FIN_ENV: "32"},
    {FOLD_ENV: "0"},
]
# The fp32-weight and RMSNorm rows: the default and the PDL switch only (they share the
# kernels; these rows check the levers carry over).
SHORT_VARIANTS = [{}, {PDL_ENV: "0"}]
FWD_ONLY_VARIANTS = [{}, {PDL_ENV: "0"}, {FWD_ENV: "r1"}]
# The quick round: the default (split4 at rows of <= 1024 bf16) against run 5's table.
SPLIT_VARIANTS = [{}, {BWD_ENV: "b256"}, {BWD_ENV: "b512"}]
SPLIT_CASES = [(16384, 1024), (65536, 768)]
# The backward-only rows: every fwd+bwd variant that touches the backward.
BWD_ONLY_VARIANTS = [v for v in FULL_VARIANTS if FWD_ENV not in v]
# run 8's quick round (MPT_BENCH_NORM=fold): the in-kernel finish against the separate kernel.
FOLD_VARIANTS = [{}, {FOLD_ENV: "0"}]


@contextlib.contextmanager
def variant_env(variant: dict):
    """All switches set (defaults filled in), so an outer setting never leaks in."""
    with contextlib.ExitStack() as stack:
        for k, v in {**DEFAULTS, **variant}.items():
            stack.enter_context(env_var(k, v))
        yield


def variant_label(variant: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in variant.items() if v != DEFAULTS[k])


def _named(name: str, variant: dict) -> str:
    label = variant_label(variant)
    return f"{name} [{label}]" if label else name


def _leaves(inputs):
    x, w, b, _ = inputs
    return (x, w) if b is None else (x, w, b)


def _fwd_bwd(norm, inputs):
    x, w, b, dy = inputs
    return torch.autograd.grad(norm(x, w, b), _leaves(inputs), dy)


def _fwd(norm, inputs):
    x, w, b, _ = inputs
    with torch.no_grad():
        return norm(x, w, b)


def _check(got, expected):
    """Never time a broken kernel: ours against torch on the first input set (a tensor or
    a sequence of them)."""
    if isinstance(got, torch.Tensor):
        got, expected = [got], [expected]
    for a, t in zip(got, expected):
        torch.testing.assert_close(a.float(), t.float(), rtol=3e-2, atol=3e-2 * max(1.0, t.abs().max().item()))


def _norms(kind, hidden):
    shape = (hidden,)
    if kind == "rms":
        ours = lambda x, w, b: ops.rms_norm(x, shape, w, 1e-6, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.rms_norm(x, shape, w.to(x.dtype), 1e-6)  # noqa: E731
    else:
        ours = lambda x, w, b: ops.layer_norm(x, shape, w, b, 1e-5, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, shape, w.to(x.dtype), b.to(x.dtype), 1e-5)  # noqa: E731
    return ours, theirs


def _make_sets(rows, hidden, kind, wdtype):
    dt = torch.bfloat16
    # A private generator: a failed graph capture elsewhere can leave the default CUDA
    # generator marked as capturing, and every later torch.randn would then raise.
    g = torch.Generator(device="cuda")
    g.manual_seed(rows * 7919 + hidden)

    def rand(*size, dtype=torch.float32):
        return torch.randn(*size, device="cuda", dtype=dtype, generator=g)

    def make():
        x = rand(rows, hidden, dtype=dt).requires_grad_()
        w = (rand(hidden) * 0.1 + 1).to(wdtype).requires_grad_()
        b = None if kind == "rms" else rand(hidden).to(wdtype).requires_grad_()
        return x, w, b, rand(rows, hidden, dtype=dt)

    return Rotating(make, sets_for(4 * rows * hidden * dt.itemsize))


def _case_name(kind, wdtype, what, rows, hidden):
    wname = "fp32 w" if wdtype == torch.float32 else "bf16 w"
    return f"{'RMSNorm' if kind == 'rms' else 'LayerNorm'} {what} bf16 ({wname}) {rows}x{hidden}"


def _result(name, variant, t_ours, how, t_torch, how_torch, rows, hidden, elem_bytes, what):
    return Result(
        case=_named(name, variant),
        ours_ms=t_ours,
        torch_ms=t_torch,
        floor_ms=floor_ms(elem_bytes * rows * hidden),
        extra={"rows": rows, "hidden": hidden, "bytes_per_elem": elem_bytes, "pass": what,
               **{k: variant.get(k, DEFAULTS[k]) for k in DEFAULTS}, "timing": how, "timing_torch": how_torch},
    )


def _fwd_bwd_rows(rows, hidden, kind, wdtype, variants, rep) -> list[Result]:
    sets = _make_sets(rows, hidden, kind, wdtype)
    ours, theirs = _norms(kind, hidden)
    expected = _fwd_bwd(theirs, sets.sets[0])
    # torch's LayerNorm needs the weights in x's dtype: the fp32-weight case times its casts
    # too, which is what a *-master model would have to do without the fused kernel.
    torch_timed = step_ms(lambda s: _fwd_bwd(theirs, s), sets.sets, rep)
    name = _case_name(kind, wdtype, "fwd+bwd", rows, hidden)
    return _variant_rows(name, variants, lambda s: _fwd_bwd(ours, s), sets.sets, expected, torch_timed,
                         rows, hidden, 10, "fwd+bwd", rep)


def _variant_rows(name, variants, step, inputs, expected, torch_timed, rows, hidden, elem_bytes, what, rep):
    """One row per launch variant: ``step`` checked against ``expected`` on the first input
    set, then graph-timed over ``inputs`` with the variant's switches set."""
    out = []
    for variant in variants:
        with variant_env(variant):
            timed = _guarded(name, variant, lambda: (_check(step(inputs[0]), expected),
                                                     step_ms(step, inputs, rep))[1])
        if timed:
            out.append(_result(name, variant, *timed, *torch_timed, rows, hidden, elem_bytes, what))
    return out


def _fwd_only_rows(rows, hidden, rep, variants=None) -> list[Result]:
    sets = _make_sets(rows, hidden, "layer", torch.bfloat16)
    ours, theirs = _norms("layer", hidden)
    expected = _fwd(theirs, sets.sets[0])
    torch_timed = step_ms(lambda s: _fwd(theirs, s), sets.sets, rep)
    name = _case_name("layer", torch.bfloat16, "fwd", rows, hidden) + " [4 B/elem]"
    return _variant_rows(name, FWD_ONLY_VARIANTS if variants is None else variants, lambda s: _fwd(ours, s),
                         sets.sets, expected, torch_timed, rows, hidden, 4, "fwd", rep)


def _guarded(name, variant, timed):
    """A variant that fails its check (or raises) is reported and skipped, not fatal: the
    other rows of the family still come out."""
    try:
        return timed()
    except Exception:  # noqa: BLE001 - reported, the family goes on
        print(f"[bench norm] {_named(name, variant)} FAILED, skipped:\n{traceback.format_exc()}", flush=True)
        torch.cuda.synchronize()
        return None


def _bwd_only_rows(rows, hidden, rep, variants=None) -> list[Result]:
    """The backward ops called directly (ours: the extension's layer_norm_backward; torch:
    aten's native_layer_norm_backward) on statistics from one forward per set.  Not through
    autograd: the engine would run a backward on the stream of its forward, outside the
    capture stream, and capture would fail."""
    sets = _make_sets(rows, hidden, "layer", torch.bfloat16)
    ext = ops.get_extension(required=True)
    shape, eps = [hidden], 1e-5
    ours_in, theirs_in = [], []
    with torch.no_grad():
        for x, w, b, dy in sets.sets:
            _, mean, rstd, work = ext.layer_norm_forward(x, w, b, hidden, eps, False)
            ours_in.append((dy, x, mean, rstd, w, b, work))
            wt, bt = w.to(x.dtype), b.to(x.dtype)
            _, tmean, trstd = torch.ops.aten.native_layer_norm(x, shape, wt, bt, eps)
            theirs_in.append((dy, x, tmean, trstd, wt, bt))

    @torch.no_grad()
    def ours(a):
        dy, x, mean, rstd, w, b, work = a
        return ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, work)

    @torch.no_grad()
    def theirs(a):
        dy, x, mean, rstd, w, b = a
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, w, b, [True, True, True])

    expected = theirs(theirs_in[0])
    torch_timed = step_ms(theirs, theirs_in, rep)
    name = _case_name("layer", torch.bfloat16, "bwd", rows, hidden) + " [6 B/elem]"
    return _variant_rows(name, BWD_ONLY_VARIANTS if variants is None else variants, ours, ours_in, expected,
                         torch_timed, rows, hidden, 6, "bwd", rep)


def run_split() -> list[Result]:
    """The quick round: the default backward (split4 at these shapes) against b256 / b512."""
    results = []
    for rows, hidden in SPLIT_CASES:
        results += _bwd_only_rows(rows, hidden, 100.0, SPLIT_VARIANTS)
        results += _fwd_bwd_rows(rows, hidden, "layer", torch.bfloat16, SPLIT_VARIANTS, 100.0)
    return results


def run_fold() -> list[Result]:
    """Run 8's quick round: dgamma / dbeta finished in the backward against the separate
    finish kernel, as bwd and fwd+bwd rows at the three target shapes."""
    results = []
    for rows, hidden in CASES:
        results += _bwd_only_rows(rows, hidden, 100.0, FOLD_VARIANTS)
        results += _fwd_bwd_rows(rows, hidden, "layer", torch.bfloat16, FOLD_VARIANTS, 100.0)
    return results


def run(args) -> list[Result]:
    only = os.environ.get("MPT_BENCH_NORM", "")
    if only == "split":
        return run_split()
    if only == "fold":
        return run_fold()
    if only:
        raise ValueError(f"MPT_BENCH_NORM={only!r}: unknown subset; use 'split', 'fold' or leave it unset")
    results = []
    cases = QUICK_CASES if args.quick else CASES
    rep = 50.0 if args.quick else 200.0
    for rows, hidden in cases:
        results += _fwd_bwd_rows(rows, hidden, "layer", torch.bfloat16, FULL_VARIANTS, rep)
        results += _fwd_only_rows(rows, hidden, rep)
        results += _bwd_only_rows(rows, hidden, rep)
    for rows, hidden in cases:
        results += _fwd_bwd_rows(rows, hidden, "layer", torch.float32, SHORT_VARIANTS, rep)
        results += _fwd_bwd_rows(rows, hidden, "rms", torch.bfloat16, SHORT_VARIANTS, rep)
    return results
