"""Max-pool benchmark cases: the shipped kernels (csrc/max_pool.cu) vs torch's (ATen's channels_last
kernels), both as GPU work (steps captured in one CUDA graph: graph_timing.py), at ResNet-50's stem pool
(3x3, stride 2, padding 1 over 256x64x112x112 fp16, channels_last).

Floor (DESIGN §5), per input element e and output element o: the forward reads x (2 B/e) and writes y
(2 B/o) and the int8 offsets (1 B/o); the backward reads dy and the offsets (3 B/o) and writes dx
(2 B/e).  ATen moves int64 indices (8 B/o) instead of the offsets: its rows pay for that.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.common import Result, floor_ms, input_sets
from mptrain.bench.graph_timing import step_ms

CASES = [(256, 64, 112)]
QUICK_CASES = [(16, 64, 56)]
OPS = torch.ops.mptrain


def _one_case(n, c, hw, args) -> list[Result]:
    dt, cl = torch.float16, torch.channels_last
    k, s, p = [3, 3], [2, 2], [1, 1]
    ho = (hw + 2 - 3) // 2 + 1

    def make():
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=dt).contiguous(memory_format=cl).requires_grad_()
        return x, torch.randn(n, c, ho, ho, device="cuda", dtype=dt).contiguous(memory_format=cl)

    e, o = n * c * hw * hw, n * c * ho * ho
    sets = input_sets(make, 2 * e + 2 * o)
    rep = 50.0 if args.quick else 200.0
    name = f"max_pool 3x3/2 fp16 channels_last {n}x{c}x{hw}x{hw}"
    extra = {"shape": [n, c, hw, hw], "kernel": k, "stride": s, "padding": p}

    def fwd(fn):
        return torch.no_grad()(lambda st: fn(st[0]))

    def fwd_bwd(fn):
        return lambda st: torch.autograd.grad(fn(st[0]), (st[0],), st[1])[0]

    ours = lambda x: ops.max_pool2d(x, 3, 2, 1, fused=True)  # noqa: E731
    theirs = lambda x: F.max_pool2d(x, 3, 2, 1)  # noqa: E731
    # Never time a broken kernel.
    assert torch.equal(fwd(ours)(sets[0]), fwd(theirs)(sets[0])), "max_pool2d forward differs from torch's"
    assert torch.equal(fwd_bwd(ours)(sets[0]), fwd_bwd(theirs)(sets[0])), "max_pool2d gradient differs from torch's"
    rows = []
    for label, make_fn, nbytes in (("fwd+bwd", fwd_bwd, 4 * e + 5 * o), ("fwd only", fwd, 2 * e + 3 * o)):
        t_torch, how_torch = step_ms(make_fn(theirs), sets, rep)
        t_ours, how = step_ms(make_fn(ours), sets, rep)
        rows.append(Result(f"{name} {label}", t_ours, t_torch, floor_ms(nbytes),
                           {**extra, "timing": how, "timing_torch": how_torch}))
    # Backward alone, on saved offsets / indices.
    saved = [(OPS.max_pool2d(x.detach(), k, s, p)[1], F.max_pool2d(x.detach(), 3, 2, 1, return_indices=True)[1], dy)
             for x, dy in sets]

    def ours_b(i):
        return OPS.max_pool2d_backward(saved[i][2], saved[i][0], [hw, hw], k, s, p)

    def theirs_b(i):
        x = sets[i][0]
        return torch.ops.aten.max_pool2d_with_indices_backward(saved[i][2], x, k, s, p, [1, 1], False, saved[i][1])

    idx = list(range(len(sets)))
    t_b_torch, _ = step_ms(theirs_b, idx, rep)
    t_b, how_b = step_ms(ours_b, idx, rep)
    rows.append(Result(f"{name} bwd only", t_b, t_b_torch, floor_ms(2 * e + 3 * o), {**extra, "timing": how_b}))
    return rows


def run(args) -> list[Result]:
    return [r for n, c, hw in (QUICK_CASES if args.quick else CASES) for r in _one_case(n, c, hw, args)]
