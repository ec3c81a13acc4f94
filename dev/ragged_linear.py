"""A 16-bit linear layer whose output width is not a multiple of 8 (a vocabulary projection: BERT's
30522, GPT-2's 50257), computed as is and with its weight zero-padded to a multiple of 64 at every
call: GPU time of forward + backward, eager and compiled.  Two padded variants: the sliced view as
output (a lab variant), and the shipped mptrain.nn.PaddedLinear (a contiguous output).  (lab tool)

    python3 dev/ragged_linear.py            # the layer alone
    python3 dev/ragged_linear.py --gpt2     # a GPT-2 (124M) training step, its tied head plain vs PaddedLinear

Why: a row-major (N, K) operand's other orientation has a leading dimension of N elements; at
N = 30522 bf16 that is 61044 bytes, not 16-byte aligned, and cuBLAS then cannot take its
tensor-core kernels with vector loads.  dev/fp8_gemm.py measured the BERT e2e case's decoder (2560 x
768 x 30522, fwd + 2 bwd GEMMs) at 1.51 ms, against 0.37 ms for the 16384 x 768 x 3072 FFN GEMMs
with 2.5x its FLOPs.  Times: triton's do_bench_cudagraph median (CUDA-graph replay, GPU time).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from triton.testing import do_bench_cudagraph

from mptrain.nn import PaddedLinear

BF16 = torch.bfloat16
CASES = [("BERT MLM decoder", 2560, 768, 30522), ("GPT-2 LM head", 8192, 768, 50257),
         ("aligned control", 2560, 768, 30528)]


def plain(x, w, b):
    return F.linear(x, w, b)


def pad_call(x, w, b):
    """Padded like PaddedLinear, but the output left a strided view of the padded product."""
    n = w.shape[0]
    extra = -n % PaddedLinear.MULTIPLE
    return F.linear(x, F.pad(w, (0, 0, 0, extra)), F.pad(b, (0, extra)))[..., :n]


def shipped(x, w, b):
    """mptrain.nn.PaddedLinear's forward with w and b as its parameters (gradients flow to them)."""
    m = PaddedLinear.from_module(nn.Linear(w.shape[1], w.shape[0], device="meta"))
    return torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))


def fwd_bwd(fn, x, w, b, g):
    return lambda: torch.autograd.grad(fn(x, w, b), (x, w, b), g)


def gpt2_step_ms(padded: bool, batch: int = 8, seq: int = 1024, warmup: int = 5, steps: int = 20) -> float:
    """Wall ms per bf16 training step (forward, LM loss, backward, fused AdamW) of transformers' GPT-2 small,
    random init; ``padded``: its tied 768 -> 50257 head as mptrain.nn.PaddedLinear (nothing else swapped)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=seq)).cuda().to(BF16)
    if padded:
        PaddedLinear.from_module(model.lm_head)
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 50257, (batch, seq), device="cuda")
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def gpt2(rounds: int = 2) -> int:
    print("GPT-2 small, bf16, batch 8 x 1024 tokens: ms per training step (alternating)")
    for r in range(rounds):
        for padded in ((False, True) if r % 2 == 0 else (True, False)):
            print(f"round {r + 1}: head {'PaddedLinear' if padded else 'nn.Linear':<12} {gpt2_step_ms(padded):8.2f} ms",
                  flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description="a ragged 16-bit linear, plain and padded")
    p.add_argument("--gpt2", action="store_true", help="time GPT-2 small's training step instead of the layer")
    if p.parse_args().gpt2:
        return gpt2()
    print(f"{'case':<20} {'M x K x N':>18} {'mode':>8} {'plain ms':>9} {'padded ms':>10} {'speed-up':>9} "
          f"{'PaddedLinear':>12} {'speed-up':>9}")
    for name, M, K, N in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
        w = (torch.randn(N, K, device="cuda", dtype=BF16, generator=gen) * K ** -0.5).requires_grad_()
        b = torch.zeros(N, device="cuda", dtype=BF16, requires_grad=True)
        g = torch.randn(M, N, device="cuda", dtype=BF16, generator=gen)
        want = torch.autograd.grad(plain(x, w, b), (x, w, b), g)
        for fn in (pad_call, shipped):
            got = torch.autograd.grad(fn(x, w, b), (x, w, b), g)
            for a, r in zip(got, want):  # same product: only the rounding of a different kernel may differ
                err = ((a.float() - r.float()).norm() / r.float().norm()).item()
                assert err < 1e-2, (name, fn.__name__, err)
        for mode in ("eager", "compile"):
            fns = (plain, pad_call, shipped)
            if mode == "compile":
                fns = tuple(torch.compile(f) for f in fns)
            t = []
            for fn in fns:
                step = fwd_bwd(fn, x, w, b, g)
                step()
                t.append(float(do_bench_cudagraph(step, rep=50, return_mode="median")))
            print(f"{name:<20} {f'{M}x{K}x{N}':>18} {mode:>8} {t[0]:9.4f} {t[1]:10.4f} {t[0] / t[1]:8.2f}x "
                  f"{t[2]:12.4f} {t[0] / t[2]:8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
