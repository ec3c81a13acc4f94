"""Torch-function calls of one BERT-base forward (lab tool, not shipped): what the fp32-fallback
TorchFunctionMode intercepts, by function and by the source line that made the call.

    python3 dev/count_torch_calls.py [--quick] [--stock] [--precision bf16-mixed]
"""
from __future__ import annotations

import argparse
import collections
import traceback

import torch

from mptrain.bench.e2e_models import build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stock", action="store_true", help="torch's LayerNorm (Lightning's model)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module, batches, _ = build("bert", 2, device, quick=args.quick, stock=args.stock)
    net = next(m for m in module.modules() if type(m).__name__ == "MaskedLMNet").to(device)
    batch = next(iter(batches))
    by_func, by_site = collections.Counter(), collections.Counter()

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            by_func[getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))] += 1
            f = next(f for f in reversed(traceback.extract_stack(limit=6)[:-1])
                     if not f.filename.endswith("torch/overrides.py"))
            by_site[f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"] += 1
            return func(*args, **(kwargs or {}))

    dtype = getattr(torch, args.dtype)
    with torch.autocast(device, dtype=dtype), Count():
        net(batch["input_ids"], batch["labels"])
    print(f"{sum(by_func.values())} torch-function calls per forward ({device}, autocast {dtype})")
    for title, counter in (("by function", by_func), ("by call site", by_site)):
        print(f"-- {title}")
        for k, v in counter.most_common(args.rows):
            print(f"{v:6d}  {k}")


if __name__ == "__main__":
    main()
