"""Scaled masked softmax benchmark cases: the shipped kernels vs torch eager (scale, masked_fill,
softmax), both sides as GPU work (steps captured in one CUDA graph: graph_timing.py).

Floor (DESIGN §5), bf16: forward reads x, writes y (4 B/elem); backward reads y, dy, writes dx
(6 B/elem); the [B, 1, Sq, Sk] mask, broadcast over heads, is not counted.  Rows per shape and mask
(random [B, 1, S, S], or causal): ``fwd+bwd`` (the target); at 512 also ``fwd only`` and ``bwd only``
(the backward entry point called on saved outputs).
"""
from __future__ import annotations

import torch

from mptrain import ops
from mptrain.bench.common import Result, floor_ms, input_sets
from mptrain.bench.graph_timing import step_ms
from mptrain.compat import torch as compat

# (batch, heads, S): 512x512x512 and 128x2048x2048 rows x cols, the shapes Megatron's fused softmax is
# compared at (docs/kernels/softmax.md).
CASES = [(32, 16, 512), (8, 16, 2048)]
QUICK_CASES = [(32, 16, 512)]
SCALE = 0.125
# Lengths that also get the forward-only and backward-only rows.
HALF_LENGTHS = (512,)


def _eager(x, mask):
    """What models write without a fused kernel (the causal mask is built once, outside)."""
    return torch.softmax((x * SCALE).masked_fill(mask, float("-inf")), dim=-1)


def _fwd_bwd(fn, inputs):
    x, mask, dy = inputs
    return torch.autograd.grad(fn(x, mask), (x,), dy)[0]


def _no_grad(fn):
    return torch.no_grad()(lambda inputs: fn(inputs[0], inputs[1]))


def _one_case(b, h, s, masked, causal, args) -> list[Result]:
    dt = torch.bfloat16

    def make():
        x = torch.randn(b, h, s, s, device="cuda", dtype=dt, requires_grad=True)
        mask = (torch.rand(b, 1, s, s, device="cuda") < 0.1) if masked else None
        return x, mask, torch.randn(b, h, s, s, device="cuda", dtype=dt)

    sets = input_sets(make, 2 * b * h * s * s * dt.itemsize)
    ours = lambda x, m: ops.scaled_masked_softmax(x, m, SCALE, causal, fused=True)  # noqa: E731
    tri = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1) if causal else None
    theirs = lambda x, m: _eager(x, tri if causal else m)  # noqa: E731
    rep = 50.0 if args.quick else 200.0
    what = "causal" if causal else ("masked [B,1,S,S]" if masked else "no mask")
    name = f"softmax fwd+bwd bf16 {what} {b * h}x{s}x{s}"
    extra = {"batch": b, "heads": h, "seq": s, "mask": what}
    # Never time a broken kernel.
    torch.testing.assert_close(_fwd_bwd(ours, sets[0]).float(), _fwd_bwd(theirs, sets[0]).float(),
                               rtol=3e-2, atol=3e-2)
    t_torch, how_torch = step_ms(lambda st: _fwd_bwd(theirs, st), sets, rep)
    t_ours, how = step_ms(lambda st: _fwd_bwd(ours, st), sets, rep)
    results = [Result(name, t_ours, t_torch, floor_ms(10 * b * h * s * s),
                      {**extra, "timing": how, "timing_torch": how_torch})]
    if s in HALF_LENGTHS:
        results += _halves(b, h, s, causal, sets, ours, theirs, rep, name, extra)
    return results


def _halves(b, h, s, causal, sets, ours, theirs, rep, name, extra) -> list[Result]:
    """Forward alone (4 B/elem) and backward alone (6 B/elem), beside torch eager's forward
    (scale, masked_fill, softmax) and its softmax backward."""
    dt = torch.bfloat16
    ext = ops.get_extension(required=True)
    elems = b * h * s * s
    base = name.replace("fwd+bwd ", "")
    torch.testing.assert_close(_no_grad(ours)(sets[0]).float(), _no_grad(theirs)(sets[0]).float(),
                               rtol=3e-2, atol=3e-2)
    t_f, how = step_ms(_no_grad(ours), sets, rep)
    t_f_torch, _ = step_ms(_no_grad(theirs), sets, rep)
    # Saved outputs for the backward: one per input set (a backward reads y and dy).
    bwd_sets = [(_no_grad(ours)((x, m)), dy) for x, m, dy in sets]

    def ours_b(st):
        return ext.scaled_masked_softmax_backward(st[1], st[0], SCALE)

    def theirs_b(st):
        return compat.softmax_backward(st[1], st[0], -1, dt).mul_(SCALE)

    torch.testing.assert_close(ours_b(bwd_sets[0]).float(), theirs_b(bwd_sets[0]).float(), rtol=3e-2, atol=3e-2)
    t_b, how_b = step_ms(ours_b, bwd_sets, rep)
    t_b_torch, _ = step_ms(theirs_b, bwd_sets, rep)
    del bwd_sets
    return [
        Result(f"{base} fwd only [4 B/elem]", t_f, t_f_torch, floor_ms(4 * elems), {**extra, "timing": how}),
        Result(f"{base} bwd only [6 B/elem]", t_b, t_b_torch, floor_ms(6 * elems), {**extra, "timing": how_b}),
    ]


def run(args) -> list[Result]:
    cases = QUICK_CASES if args.quick else CASES
    results = []
    for masked, causal in ((True, False), (False, True)):
        for b, h, s in cases:
            results += _one_case(b, h, s, masked, causal, args)
    return results
