"""Host cost of one call under the fp32-fallback context, on the CPU (lab tool, not shipped).

    python3 dev/fallback_host.py

Tiny bf16 tensors, one thread: the figures are the host time a host-bound step pays per call.
Rows: an unlisted op (passes through the mode) and two listed ops (upcast, run with autocast off,
cast back), each with autocast off and on, without and with ``Fp32Fallback("default").context()``.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mptrain.precision.fallback import Fp32Fallback


def per_call_us(fn, n=20000) -> float:
    for _ in range(n // 10):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(2, 8, 8, dtype=torch.bfloat16)
    w, b = torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    calls = {"add (unlisted)": lambda: x + x, "F.layer_norm": lambda: F.layer_norm(x, (8,), w, b),
             "torch.softmax": lambda: torch.softmax(x, -1)}
    print(f"{'call':16} {'autocast':8} {'plain us':>9} {'fallback us':>12}")
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for name, fn in calls.items():
                plain = per_call_us(fn)
                with Fp32Fallback("default").context():
                    under = per_call_us(fn)
                print(f"{name:16} {str(autocast):8} {plain:9.2f} {under:12.2f}")


if __name__ == "__main__":
    main()
