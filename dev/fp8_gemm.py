"""Could fp8 GEMMs take BERT-base to 1.3x Lightning + torch.compile? (lab tool, not shipped)

    python3 -m mptrain.bench.e2e --models bert --cases lightning+compile:bf16-true,mptrain+compile+cuda_graphs:best \
        --out e2e.json && python3 dev/fp8_gemm.py --e2e e2e.json     # or --step-ms S --baseline-ms B

The e2e BERT case (BERT-base MLM, batch 128, seq 128, 20 predictions per sequence) runs the same
GEMMs under both trainers; its compiled step is GPU-bound and GEMM-bound.  Less arithmetic time is
the only lever left, and fp8 is the precision lever.  This times every linear layer's three GEMMs
(forward Y = X W^T, backward dX = dY W and dW = dY^T X) at the case's shapes:

* bf16: ``torch.mm``, what both trainers run today;
* fp8, GEMMs only: ``torch._scaled_mm`` on operands already in fp8 (e4m3 activations and weights,
  e5m2 gradients, tensorwise scales, as torchao's float8 training and TransformerEngine's default
  recipe), in the layouts it needs (row-major A, column-major B).  A lower bound: the
  quantization is free;
* fp8 with quantization: amax, scale and cast of X, W and dY from bf16, the transposed fp8 copies
  the backward GEMMs need, and the three GEMMs, in one ``torch.compile``'d function per linear
  (inductor fuses the casts as far as it can).  In a compiled model some casts could fold into the
  producer's pointwise kernel, so the step's real cost lies between the two fp8 rows.

Each time is GPU time: triton's ``do_bench_cudagraph`` median (the call captured in a CUDA graph and
replayed; host time, dynamo's guards included, would otherwise dominate the small linears, and the
L2 is not flushed between replays: the same for every row).  Summed over the step's
linears, the saving against bf16 is subtracted from ``--step-ms`` (mptrain's best compiled step,
ms) and the result compared with ``--baseline-ms`` (Lightning + torch.compile's best step, ms):
the ratio an fp8 mode could reach.  ``--e2e`` reads both from one ``mptrain bench e2e --out`` file.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def median_ms(fn, rep_ms: float) -> float:
    """GPU time of ``fn`` in ms: median CUDA-graph replay (triton.testing.do_bench_cudagraph)."""
    from triton.testing import do_bench_cudagraph

    fn()  # compiled functions compile (and warm up) before the capture
    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


BF16, E4, E5 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
TOKENS, PREDICTED = 128 * 128, 128 * 20

#: (name, M rows, K in, N out, linears of this shape per step) for BERT-base: q, k, v and the
#: attention output are separate 768 -> 768 linears in transformers' BertSelfAttention.
SHAPES = [
    ("q/k/v/attn-out 768->768", TOKENS, 768, 768, 48),
    ("ffn up 768->3072", TOKENS, 768, 3072, 12),
    ("ffn down 3072->768", TOKENS, 3072, 768, 12),
    ("head transform 768->768", PREDICTED, 768, 768, 1),
    ("decoder 768->30522", PREDICTED, 768, 30522, 1),
]


def quant(t: torch.Tensor, dtype: torch.dtype):
    """t in ``dtype`` with a tensorwise scale (amax -> the format's max) and the inverse scale."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).to(dtype), scale.reciprocal()


def fp8_linear(x, w, dy):
    """One linear's forward and backward GEMMs in fp8 from bf16 operands."""
    x8, sx = quant(x, E4)
    w8, sw = quant(w, E4)
    g8, sg = quant(dy, E5)
    y = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=BF16, use_fast_accum=True)
    dx = torch._scaled_mm(g8, w8.t().contiguous().t(), sg, sw, out_dtype=BF16)
    dw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), sg, sx, out_dtype=BF16)
    return y, dx, dw


def time_shape(M, K, N, rep_ms):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=BF16, generator=g) * K ** -0.5
    dy = torch.randn(M, N, device="cuda", dtype=BF16, generator=g)
    t = {"bf16": sum(median_ms(f, rep_ms=rep_ms) for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x))}
    if N % 16 or K % 16 or M % 16:
        return t, "bf16 kept (_scaled_mm needs multiples of 16)"
    one = torch.ones((), device="cuda")
    x8, w8, g8 = x.to(E4), w.to(E4), dy.to(E5)
    w8t, g8t, x8t = w8.t().contiguous(), g8.t().contiguous(), x8.t().contiguous()
    gemms = (lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=BF16, use_fast_accum=True),
             lambda: torch._scaled_mm(g8, w8t.t(), one, one, out_dtype=BF16),
             lambda: torch._scaled_mm(g8t, x8t.t(), one, one, out_dtype=BF16))
    t["fp8 gemms"] = sum(median_ms(f, rep_ms=rep_ms) for f in gemms)
    ref = (x.float() @ w.float().t(), dy.float() @ w.float(), dy.float().t() @ x.float())
    try:
        compiled = torch.compile(fp8_linear, fullgraph=True, dynamic=False)
        got = compiled(x, w, dy)
        note = ""
    except Exception as e:  # noqa: BLE001 -- a lab tool reports what failed and times the eager version
        compiled, got = fp8_linear, fp8_linear(x, w, dy)
        note = f"compile failed ({type(e).__name__}: {str(e).splitlines()[0][:80]}); eager quantization"
    for name, a, b in zip(("y", "dx", "dw"), got, ref):  # the fp8 result must be the product, to fp8's precision
        err = ((a.float() - b).norm() / b.norm()).item()
        if err > 0.1:
            raise SystemExit(f"fp8 {name} at {M}x{K}x{N}: relative error {err:.3f} (> 0.1): the fp8 path is wrong")
    t["fp8 + quant"] = median_ms(lambda: compiled(x, w, dy), rep_ms=rep_ms)
    return t, note


def e2e_steps(path: str) -> tuple[float, float]:
    """(mptrain's fastest BERT step, Lightning + compile's fastest) in ms from an e2e JSON file."""
    rows = [r for r in json.load(open(path))["results"] if r["model"] == "bert" and r["step_ms"]]
    ours = [r["step_ms"] for r in rows if r["case"].startswith("mptrain")]
    theirs = [r["step_ms"] for r in rows if r["case"].startswith("lightning+compile")]
    if not ours or not theirs:
        raise SystemExit(f"{path}: needs a BERT mptrain case and a lightning+compile case that ran")
    return min(ours), min(theirs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--e2e", metavar="FILE.json", help="`mptrain bench e2e --out` file with BERT cases of both")
    p.add_argument("--step-ms", type=float, help="mptrain's best compiled BERT step, ms")
    p.add_argument("--baseline-ms", type=float, help="Lightning + torch.compile's best step, ms")
    p.add_argument("--rep-ms", type=float, default=100.0)
    a = p.parse_args(argv)
    if a.e2e:
        a.step_ms, a.baseline_ms = e2e_steps(a.e2e)
    if (a.step_ms is None) != (a.baseline_ms is None):
        p.error("give both --step-ms and --baseline-ms (or --e2e FILE.json), or neither (GEMM sums only)")
    totals = {"bf16": 0.0, "fp8 gemms": 0.0, "fp8 + quant": 0.0}
    print(f"{'shape':<26} {'x/step':>6} {'bf16 ms':>8} {'fp8 gemms':>10} {'fp8+quant':>10}  (fwd + 2 bwd GEMMs, one linear)")
    for name, M, K, N, count in SHAPES:
        t, note = time_shape(M, K, N, a.rep_ms)
        for k in totals:
            totals[k] += count * t.get(k, t["bf16"])  # a shape fp8 cannot take stays bf16
        cells = [f"{t[k]:10.4f}" if k in t else f"{'—':>10}" for k in ("fp8 gemms", "fp8 + quant")]
        print(f"{name:<26} {count:6d} {t['bf16']:8.4f} {cells[0]} {cells[1]}  {note}", flush=True)
    print(f"\nper step: bf16 GEMMs {totals['bf16']:.2f} ms; fp8 GEMMs only {totals['fp8 gemms']:.2f} ms; "
          f"fp8 with quantization {totals['fp8 + quant']:.2f} ms")
    for k in ("fp8 gemms", "fp8 + quant") if a.step_ms is not None else ():
        step = a.step_ms - (totals["bf16"] - totals[k])
        print(f"step with {k:<12}: {step:.2f} ms -> {a.baseline_ms / step:.3f}x Lightning + compile "
              f"({a.baseline_ms:.2f} ms; today {a.baseline_ms / a.step_ms:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
