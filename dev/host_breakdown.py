"""Where the host time of one eager op call goes (lab tool, not shipped): the tiny LayerNorm forward
split into its layers (Python wrapper, boxed ``torch.ops`` call, autograd node) beside torch's, and
torch.profiler's CPU tables of the LSTM cell's forward+backward, ours and ``nn.LSTMCell``'s.

    python3 dev/host_breakdown.py [--rows 25]
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
    for name, fn in calls.items():
        on = per_call_us(fn, iters, torch.cuda.synchronize)
        with torch.no_grad():
            off = per_call_us(fn, iters, torch.cuda.synchronize)
        print(f"  {name:<52} {on:7.2f} / {off:7.2f}")


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
            print(f"lstm {batch}x1024 {name}: fwd {per_call_us(f, 200, torch.cuda.synchronize):.1f} us, "
                  f"fwd+bwd {per_call_us(fwd_bwd, 200, torch.cuda.synchronize):.1f} us")
            profiled(f"LSTM cell {batch}x1024 fwd+bwd, {name}", fwd_bwd, rows)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args(argv)
    print(f"extension: {ops.extension_status()}")
    norm_layers()
    lstm(a.rows)


if __name__ == "__main__":
    sys.exit(main())
