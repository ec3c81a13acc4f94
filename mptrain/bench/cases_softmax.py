"""Scaled masked softmax benchmark cases (issue 3): fused kernel vs torch eager
(scale, masked_fill, softmax), fwd+bwd.

Floor (DESIGN §5): forward reads x and writes y, backward reads y and dy and writes dx:
10 B/elem in bf16.  The mask is [B, 1, Sq, Sk] broadcast over the heads; its bytes are
1/heads of a score tensor's in bool and are not counted.
Timing: both sides as GPU work, several fwd+bwd steps captured in one CUDA graph
(mptrain/bench/graph_timing.py); each launch variant of ours is reported.
"""
from __future__ import annotations

import torch

from mptrain import ops
from mptrain.bench.common import Result, Rotating, floor_ms, sets_for
from mptrain.bench.graph_timing import env_var, step_ms

# (batch, heads, S): 512x512x512 and 128x2048x2048 rows x cols from the table.
CASES = [(32, 16, 512), (8, 16, 2048)]
QUICK_CASES = [(32, 16, 512)]
SCALE = 0.125
# Launch variants of csrc/softmax.cu ($MPT_SOFTMAX_SHAPE, and $MPT_SOFTMAX_BWD for the
# backward alone), the default first: (shape, backward override or "", the lengths
# where the variant differs from another one in the list).
SHAPE_ENV = "MPT_SOFTMAX_SHAPE"
BWD_ENV = "MPT_SOFTMAX_BWD"
ALL = (512, 2048)
SHAPE_VARIANTS = (
    ("auto", "", ALL),
    ("rows", "", ALL),
    ("persist", "", ALL),
    ("wide", "", ALL),
    ("pair", "", (512,)),
    # Separate the forward's and the backward's share of persist vs rows at 2048.
    ("persist", "rows", (2048,)),
    ("rows", "persist", (2048,)),
)


def _label(shape: str, bwd: str) -> str:
    return f"[{SHAPE_ENV}={shape}" + (f" {BWD_ENV}={bwd}]" if bwd else "]")


def _eager(x, mask):
    """What models write without a fused kernel (the causal mask is built once, outside)."""
    return torch.softmax((x * SCALE).masked_fill(mask, float("-inf")), dim=-1)


def _fwd_bwd(fn, inputs):
    x, mask, dy = inputs
    return torch.autograd.grad(fn(x, mask), (x,), dy)[0]


def _one_case(b, h, s, masked, causal, args) -> list[Result]:
    dt = torch.bfloat16

    def make():
        x = torch.randn(b, h, s, s, device="cuda", dtype=dt, requires_grad=True)
        mask = (torch.rand(b, 1, s, s, device="cuda") < 0.1) if masked else None
        return x, mask, torch.randn(b, h, s, s, device="cuda", dtype=dt)

    sets = Rotating(make, sets_for(2 * b * h * s * s * dt.itemsize))
    ours = lambda x, m: ops.scaled_masked_softmax(x, m, SCALE, causal, fused=True)  # noqa: E731
    tri = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1) if causal else None
    theirs = lambda x, m: _eager(x, tri if causal else m)  # noqa: E731
    expected = _fwd_bwd(theirs, sets.sets[0]).float()
    rep = 50.0 if args.quick else 200.0
    # Both sides timed as GPU work: several fwd+bwd steps in one CUDA graph (graph_timing).
    t_torch, how_torch = step_ms(lambda st: _fwd_bwd(theirs, st), sets.sets, rep)
    what = "causal" if causal else ("masked [B,1,S,S]" if masked else "no mask")
    name = f"softmax fwd+bwd bf16 {what} {b * h}x{s}x{s}"
    results = []
    # The default variant keeps the plain case name; the others are labelled.
    for variant, bwd, lengths in SHAPE_VARIANTS:
        if s not in lengths:
            continue
        with env_var(SHAPE_ENV, variant), env_var(BWD_ENV, bwd):
            # Never time a broken kernel.
            torch.testing.assert_close(_fwd_bwd(ours, sets.sets[0]).float(), expected, rtol=3e-2, atol=3e-2)
            t_ours, how = step_ms(lambda st: _fwd_bwd(ours, st), sets.sets, rep)
        results.append(Result(
            case=name if (variant, bwd) == SHAPE_VARIANTS[0][:2] else f"{name} {_label(variant, bwd)}",
            ours_ms=t_ours,
            torch_ms=t_torch,
            floor_ms=floor_ms(10 * b * h * s * s),
            extra={"batch": b, "heads": h, "seq": s, "mask": what, SHAPE_ENV: variant, BWD_ENV: bwd,
                   "timing": how, "timing_torch": how_torch},
        ))
    return results


def run(args) -> list[Result]:
    cases = QUICK_CASES if args.quick else CASES
    results = []
    for masked, causal in ((True, False), (False, True)):
        for b, h, s in cases:
            results += _one_case(b, h, s, masked, causal, args)
    return results
