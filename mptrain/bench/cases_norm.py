"""LayerNorm / RMSNorm benchmark cases (issue 3): fused kernel vs torch eager, fwd+bwd.

Floor (DESIGN §5): forward reads x and writes y, backward reads x and dy and writes dx:
10 B/elem in bf16 (the params and the fp32 mean/rstd are negligible and not counted).
Timing: both sides as GPU work, several fwd+bwd steps captured in one CUDA graph
(mptrain/bench/graph_timing.py); each backward variant of ours is reported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.common import Result, Rotating, floor_ms, sets_for
from mptrain.bench.graph_timing import env_var, step_ms

# (rows, hidden) from the target table; all bf16.
CASES = [(16384, 1024), (16384, 4096), (65536, 768)]
QUICK_CASES = [(16384, 1024)]
# Backward launch variants of csrc/layer_norm.cu ($MPT_LN_BWD), the default first.
BWD_ENV = "MPT_LN_BWD"
BWD_VARIANTS = ("auto", "b256", "b512", "coop")


def _fwd_bwd(norm, inputs):
    x, w, b, dy = inputs
    leaves = (x, w) if b is None else (x, w, b)
    return torch.autograd.grad(norm(x, w, b), leaves, dy)


def _one_case(rows, hidden, kind, wdtype, args) -> list[Result]:
    dt = torch.bfloat16
    elem_bytes = 10  # bf16: x, y forward; x, dy, dx backward

    def make():
        x = torch.randn(rows, hidden, device="cuda", dtype=dt, requires_grad=True)
        w = (torch.randn(hidden, device="cuda") * 0.1 + 1).to(wdtype).requires_grad_()
        b = None if kind == "rms" else torch.randn(hidden, device="cuda").to(wdtype).requires_grad_()
        return x, w, b, torch.randn(rows, hidden, device="cuda", dtype=dt)

    sets = Rotating(make, sets_for(4 * rows * hidden * dt.itemsize))
    shape = (hidden,)
    if kind == "rms":
        ours = lambda x, w, b: ops.rms_norm(x, shape, w, 1e-6, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.rms_norm(x, shape, w.to(x.dtype), 1e-6)  # noqa: E731
    else:
        ours = lambda x, w, b: ops.layer_norm(x, shape, w, b, 1e-5, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, shape, w.to(x.dtype), b.to(x.dtype), 1e-5)  # noqa: E731
    expected = _fwd_bwd(theirs, sets.sets[0])
    rep = 50.0 if args.quick else 200.0
    # Both sides timed as GPU work: several fwd+bwd steps in one CUDA graph (graph_timing).
    # torch's LayerNorm needs the weights in x's dtype: the fp32-weight case times its casts too,
    # which is what a *-master model would have to do without the fused kernel.
    t_torch, how_torch = step_ms(lambda s: _fwd_bwd(theirs, s), sets.sets, rep)
    wname = "fp32 w" if wdtype == torch.float32 else "bf16 w"
    name = f"{'RMSNorm' if kind == 'rms' else 'LayerNorm'} fwd+bwd bf16 ({wname}) {rows}x{hidden}"
    results = []
    # The default backward variant keeps the plain case name; the others are labelled.
    for variant in BWD_VARIANTS:
        with env_var(BWD_ENV, variant):
            # Never time a broken kernel: check against torch on the first set.
            for a, t in zip(_fwd_bwd(ours, sets.sets[0]), expected):
                torch.testing.assert_close(a.float(), t.float(), rtol=3e-2, atol=3e-2 * max(1.0, t.abs().max().item()))
            t_ours, how = step_ms(lambda s: _fwd_bwd(ours, s), sets.sets, rep)
        results.append(Result(
            case=name if variant == BWD_VARIANTS[0] else f"{name} [{BWD_ENV}={variant}]",
            ours_ms=t_ours,
            torch_ms=t_torch,
            floor_ms=floor_ms(elem_bytes * rows * hidden),
            extra={"rows": rows, "hidden": hidden, "bytes_per_elem": elem_bytes, BWD_ENV: variant,
                   "timing": how, "timing_torch": how_torch},
        ))
    return results


def run(args) -> list[Result]:
    results = []
    cases = QUICK_CASES if args.quick else CASES
    for rows, hidden in cases:
        results += _one_case(rows, hidden, "layer", torch.bfloat16, args)
    for rows, hidden in cases:
        results += _one_case(rows, hidden, "layer", torch.float32, args)
        results += _one_case(rows, hidden, "rms", torch.bfloat16, args)
    return results
