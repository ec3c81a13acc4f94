"""Scaled masked softmax benchmark cases (issue 3): fused kernel vs torch eager
(scale, masked_fill, softmax), fwd+bwd.

Floor (DESIGN §5): forward reads x and writes y, backward reads y and dy and writes dx:
10 B/elem in bf16.  The mask is [B, 1, Sq, Sk] broadcast over the heads; its bytes are
1/heads of a score tensor's in bool and are not counted.
"""
from __future__ import annotations

import torch

from mptrain import ops
from mptrain.bench.common import Result, Rotating, floor_ms, median_ms, sets_for

# (batch, heads, S): 512x512x512 and 128x2048x2048 rows x cols from the table.
CASES = [(32, 16, 512), (8, 16, 2048)]
QUICK_CASES = [(32, 16, 512)]
SCALE = 0.125


def _eager(x, mask):
    """What models write without a fused kernel (the causal mask is built once, outside)."""
    return torch.softmax((x * SCALE).masked_fill(mask, float("-inf")), dim=-1)


def _fwd_bwd(fn, inputs):
    x, mask, dy = inputs
    return torch.autograd.grad(fn(x, mask), (x,), dy)[0]


def _one_case(b, h, s, masked, causal, args) -> Result:
    dt = torch.bfloat16

    def make():
        x = torch.randn(b, h, s, s, device="cuda", dtype=dt, requires_grad=True)
        mask = (torch.rand(b, 1, s, s, device="cuda") < 0.1) if masked else None
        return x, mask, torch.randn(b, h, s, s, device="cuda", dtype=dt)

    sets = Rotating(make, sets_for(2 * b * h * s * s * dt.itemsize))
    ours = lambda x, m: ops.scaled_masked_softmax(x, m, SCALE, causal, fused=True)  # noqa: E731
    tri = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1) if causal else None
    theirs = lambda x, m: _eager(x, tri if causal else m)  # noqa: E731
    torch.testing.assert_close(_fwd_bwd(ours, sets.sets[0]).float(), _fwd_bwd(theirs, sets.sets[0]).float(),
                               rtol=3e-2, atol=3e-2)
    rep = 50.0 if args.quick else 200.0
    t_ours = median_ms(lambda: _fwd_bwd(ours, sets.next()), rep_ms=rep)
    t_torch = median_ms(lambda: _fwd_bwd(theirs, sets.next()), rep_ms=rep)
    what = "causal" if causal else ("masked [B,1,S,S]" if masked else "no mask")
    return Result(
        case=f"softmax fwd+bwd bf16 {what} {b * h}x{s}x{s}",
        ours_ms=t_ours,
        torch_ms=t_torch,
        floor_ms=floor_ms(10 * b * h * s * s),
        extra={"batch": b, "heads": h, "seq": s, "mask": what},
    )


def run(args) -> list[Result]:
    cases = QUICK_CASES if args.quick else CASES
    results = [_one_case(b, h, s, True, False, args) for b, h, s in cases]
    results += [_one_case(b, h, s, False, True, args) for b, h, s in cases]
    return results
