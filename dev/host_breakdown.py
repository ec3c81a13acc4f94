"""Where the host time of one eager op call goes (lab tool, not shipped): the tiny LayerNorm forward
split into its layers (Python wrapper, boxed ``torch.ops`` call, autograd node) beside torch's, the
engine's fixed cost (``autograd.grad`` of ``x * 2``), and torch.profiler's CPU tables of the
forward+backward of RMSNorm (4x256 and 16384x1024 bf16) and of the LSTM cell, ours and torch's.

    python3 dev/host_breakdown.py [--rows 25] [--parts norm,engine,rms,lstm]
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mptrain import ops
from mptrain.bench.host_cost import _lstm_pair, per_call_us
from mptrain.ops import dispatch
from mptrain.ops.library import OPS


def norm_layers(iters=2000):
    x = torch.randn(4, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.ones(256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = torch.zeros(256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    aten_ln = torch.ops.aten.native_layer_norm.default
    ln = OPS["layer_norm"]
    calls = {
        "F.layer_norm": lambda: F.layer_norm(x, (256,), w, b),
        "torch.native_layer_norm (generated binding)": lambda: torch.native_layer_norm(x, (256,), w, b, 1e-5),
        "torch.ops.aten.native_layer_norm.default (boxed)": lambda: aten_ln(x, (256,), w, b, 1e-5),
        "ops.layer_norm(fused=True)": lambda: ops.layer_norm(x, (256,), w, b, fused=True),
        "OPS['layer_norm'] (boxed, C++ autograd node)": lambda: ln(x, (256,), w, b, 1e-5, False),
        "dispatch.fast_norm (csrc/fast_call.cpp)": lambda: dispatch.fast_norm(x, (256,), w, b, 1e-5, False),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
    }
    ops.layer_norm(x, (256,), w, b, fused=True)  # loads the extension: OPS below is then the CUDA kernel
    print("tiny LayerNorm forward, bf16 4x256, us per call (grad mode on / no_grad)")
    names, fns = list(calls), list(calls.values())
    on = per_call_us(fns, iters, torch.cuda.synchronize)
    with torch.no_grad():
        off = per_call_us(fns, iters, torch.cuda.synchronize)
    for name, a, b in zip(names, on, off):
        print(f"  {name:<52} {a:7.2f} / {b:7.2f}")


def engine(iters=2000):
    """autograd.grad's fixed cost: one CUDA leaf, one pointwise node; and the same with .backward()."""
    x = torch.randn(4, 256, device="cuda", requires_grad=True)
    dy = torch.ones_like(x)
    fns = [lambda: torch.autograd.grad(x * 2, [x], dy), lambda: (x * 2).backward(dy), lambda: x * 2]
    us = per_call_us(fns, iters, torch.cuda.synchronize)
    print(f"\nengine: autograd.grad(x * 2) {us[0]:.1f} us, (x * 2).backward {us[1]:.1f} us, x * 2 alone {us[2]:.1f} us")


def rms(rows):
    """RMSNorm fwd+bwd, ours (fused=True) and F.rms_norm: wall time per call, then each one's CPU table."""
    for r, h in ((4, 256), (16384, 1024)):
        x = torch.randn(r, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        w = torch.ones(h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        dy = torch.ones_like(x)
        pair = {"ours": lambda: torch.autograd.grad(ops.rms_norm(x, (h,), w, fused=True), [x, w], dy),
                "F.rms_norm": lambda: torch.autograd.grad(F.rms_norm(x, (h,), w), [x, w], dy)}
        us = per_call_us(list(pair.values()), 500 if r == 4 else 100, torch.cuda.synchronize)
        print(f"\nrms_norm {r}x{h} fwd+bwd: ours {us[0]:.1f} us, F.rms_norm {us[1]:.1f} us")
        for name, fn in pair.items():
            profiled(f"rms_norm {r}x{h} fwd+bwd, {name}", fn, rows)


def profiled(title, fn, rows, iters=100):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ka) / iters
    print(f"\n#### {title}: self CPU {total:.1f} us per call (profiled)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=55))


def lstm(rows):
    for batch in (256, 1024):
        ours, ref, leaves = _lstm_pair(batch, 1024, torch.bfloat16, "cuda", True)
        dy = torch.ones_like(ref())
        for name, f in (("ours", ours), ("nn.LSTMCell", ref)):
            fwd_bwd = (lambda f=f: torch.autograd.grad(f(), leaves, dy))
            fwd, both = per_call_us([f, fwd_bwd], 200, torch.cuda.synchronize)
            print(f"lstm {batch}x1024 {name}: fwd {fwd:.1f} us, fwd+bwd {both:.1f} us")
            profiled(f"LSTM cell {batch}x1024 fwd+bwd, {name}", fwd_bwd, rows)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--parts", default="norm,engine,rms,lstm")
    a = p.parse_args(argv)
    print(f"extension: {ops.extension_status()}")
    parts = a.parts.split(",")
    for name, fn in (("norm", norm_layers), ("engine", engine), ("rms", lambda: rms(a.rows)),
                     ("lstm", lambda: lstm(a.rows))):
        if name in parts:
            fn()


if __name__ == "__main__":
    sys.exit(main())
