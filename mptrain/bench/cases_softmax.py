"""Scaled masked softmax benchmark cases (issue 3): fused kernel vs torch eager
(scale, masked_fill, softmax), fwd+bwd.

Floor (DESIGN §5): forward reads x and writes y, backward reads y and dy and writes dx:
10 B/elem in bf16.  The mask is [B, 1, Sq, Sk] broadcast over the heads; its bytes are
1/heads of a score tensor's in bool and are not counted.
Timing: both sides as GPU work, several fwd+bwd steps captured in one CUDA graph
(mptrain/bench/graph_timing.py); each launch variant of ours is reported.
"""
from __future__ import annotations

import os

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
    # Forward-only variants at 512 (backward as auto): pair = 2 rows per warp (auto's
    # masked forward where lean1 does not apply: fp32, scale <= 0); lean1 = one row per
    # warp, compile-time mask/causal, masking on raw words, ex2(FFMA) (auto's 16-bit
    # forward since run 6, so its row repeats the default: the gap is the noise).
    ("pair", "", (512,)),
    ("lean1", "", (512,)),
    # Separate the forward's and the backward's share of persist vs rows at 2048.
    ("persist", "rows", (2048,)),
    ("rows", "persist", (2048,)),
)
# Forward alone and backward alone at 512 (run 5): which half of fwd+bwd misses.
# (variant, lengths); timed for the forward under $MPT_SOFTMAX_SHAPE and for the
# backward under $MPT_SOFTMAX_BWD.
HALF_VARIANTS = (
    ("auto", (512,)),
    ("rows", (512,)),
    ("pair", (512,)),
    ("lean1", (512,)),
)
# Forward-only variants: no "bwd only" row (their backward is auto's).
FWD_ONLY = ("pair", "lean1")
# $MPT_SOFTMAX_BENCH=fwd512: only the 512 cases (masked and causal), only these variants'
# rows (fwd+bwd and fwd only), no bwd-only rows: the short run that compares the 512
# forwards (about 20 timings).
BENCH_ENV = "MPT_SOFTMAX_BENCH"
FWD512_VARIANTS = ("auto", "pair", "lean1")


def _fwd512() -> bool:
    v = os.environ.get(BENCH_ENV, "")
    if v not in ("", "fwd512"):
        raise ValueError(f"${BENCH_ENV}={v!r}: use 'fwd512' (the 512 forward rows only) or leave it unset")
    return v == "fwd512"


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
        if s not in lengths or (_fwd512() and (bwd or variant not in FWD512_VARIANTS)):
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
    results += _halves(b, h, s, masked, causal, sets, rep, name)
    return results


def _halves(b, h, s, masked, causal, sets, rep, name) -> list[Result]:
    """Forward alone (4 B/elem) and backward alone (6 B/elem) per HALF_VARIANTS, beside
    torch eager's forward (scale, masked_fill, softmax) and its softmax backward."""
    if not any(s in lengths for _, lengths in HALF_VARIANTS):
        return []
    dt = torch.bfloat16
    tri = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1) if causal else None
    ext = ops.get_extension(required=True)
    # Saved outputs for the backward: one per input set (a backward reads y and dy).
    ys = [ops.scaled_masked_softmax(x.detach(), m, SCALE, causal, fused=True) for x, m, _ in sets.sets]
    bwd_sets = [(y, dy) for y, (_, _, dy) in zip(ys, sets.sets)]

    def fwd(fn):
        def step(st):
            with torch.no_grad():
                return fn(st[0], st[1])
        return step

    ours_f = lambda x, m: ops.scaled_masked_softmax(x, m, SCALE, causal, fused=True)  # noqa: E731
    theirs_f = lambda x, m: _eager(x, tri if causal else m)  # noqa: E731
    only = _fwd512()
    t_fwd_torch, _ = step_ms(fwd(theirs_f), sets.sets, rep)
    t_bwd_torch = None if only else step_ms(
        lambda st: torch._softmax_backward_data(st[1], st[0], -1, dt).mul_(SCALE), bwd_sets, rep)[0]
    elems = b * h * s * s
    base = name.replace("fwd+bwd ", "")
    out = []
    for variant, lengths in HALF_VARIANTS:
        if s not in lengths or (only and variant not in FWD512_VARIANTS):
            continue
        with env_var(SHAPE_ENV, variant):
            # Never time a broken kernel.
            torch.testing.assert_close(fwd(ours_f)(sets.sets[0]).float(), fwd(theirs_f)(sets.sets[0]).float(),
                                       rtol=3e-2, atol=3e-2)
            t_f, how = step_ms(fwd(ours_f), sets.sets, rep)
        extra = {"batch": b, "heads": h, "seq": s, "variant": variant, "timing": how}
        out.append(Result(f"{base} fwd only [{SHAPE_ENV}={variant}]", t_f, t_fwd_torch, floor_ms(4 * elems), extra))
        if only or variant in FWD_ONLY:
            continue
        with env_var(SHAPE_ENV, "auto"), env_var(BWD_ENV, variant):
            y0, dy0 = bwd_sets[0]
            torch.testing.assert_close(ext.scaled_masked_softmax_backward(dy0, y0, SCALE).float(),
                                       (torch._softmax_backward_data(dy0, y0, -1, dt) * SCALE).float(),
                                       rtol=3e-2, atol=3e-2)
            t_b, _ = step_ms(lambda st: ext.scaled_masked_softmax_backward(st[1], st[0], SCALE), bwd_sets, rep)
        out.append(Result(f"{base} bwd only [{BWD_ENV}={variant}]", t_b, t_bwd_torch, floor_ms(6 * elems), extra))
    del ys, bwd_sets
    return out


def run(args) -> list[Result]:
    cases = QUICK_CASES if args.quick or _fwd512() else CASES
    results = []
    for masked, causal in ((True, False), (False, True)):
        for b, h, s in cases:
            results += _one_case(b, h, s, masked, causal, args)
    return results
