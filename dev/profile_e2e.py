"""Profile a few steps of `mptrain bench e2e` cases with torch.profiler (lab tool, not shipped).

    python3 dev/profile_e2e.py --model bert --cases mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)

Per case: wall ms/step of the profiled window, then the top ops by self CPU time and by
self CUDA time, and the count of aten ops per step (host work is what a host-bound step pays).
`--classes` prints instead one line per case: GPU kernel time per step by class (GEMM,
attention, optimizer, other) against the wall time, i.e. how far a step is from its GEMM +
attention time (the most any change to the rest could gain).
"""
from __future__ import annotations

import argparse
import sys
import time

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from mptrain.bench import e2e
from mptrain.bench.e2e_models import build, compile_lightning_module, use_optimizer


class Prof(L.Callback):
    def __init__(self, warmup, steps):
        self.warmup, self.steps, self.n, self.prof, self.wall_ms = warmup, steps, 0, None, 0.0

    def on_train_batch_end(self, *a):
        self.n += 1
        if self.n == self.warmup:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.n == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3 / self.steps
            self.prof.__exit__(None, None, None)


# Kernel-name fragments of each class (cuBLAS/cuBLASLt/CUTLASS GEMMs, SDPA back ends, the optimizers).
CLASSES = {
    "gemm": ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk"),
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn_generated", "efficient"),
    "optimizer": ("multi_tensor", "adam", "fused_adamw"),
}


def kernel_classes(ka, steps):
    """Self GPU ms per step by kernel class, from the kernel events of a key_averages()."""
    out = dict.fromkeys([*CLASSES, "other"], 0.0)
    for e in ka:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        name = e.key.lower()
        cls = next((c for c, frags in CLASSES.items() if any(f in name for f in frags)), "other")
        out[cls] += t / steps / 1e3
    return out


def run(model, name, warmup, steps, rows, classes=False):
    spec = e2e.CASES[name]
    prec = "bf16-master" if spec.precision == "best" else spec.precision
    module, batches, _ = build(model, warmup + steps, "cuda", stock=spec.trainer == "lightning")
    use_optimizer(module, e2e.optimizer_factory(spec.optimizer))
    if spec.trainer == "lightning" and model == "resnet50":
        module = module.to(memory_format=torch.channels_last)
    if spec.trainer == "lightning" and spec.compile:
        module = compile_lightning_module(module)
    cb = Prof(warmup, steps)
    timer = e2e.StepTimer(warmup, steps, sync_steps=0)
    trainer = e2e._trainer(spec, prec, model, timer, warmup + steps, False)
    trainer.callbacks.append(cb)
    trainer.fit(module, train_dataloaders=batches)
    ka = cb.prof.key_averages()
    if classes:
        k = kernel_classes(ka, steps)
        busy = sum(k.values())
        print(f"{model} {name} ({prec}): wall {cb.wall_ms:.2f} ms/step (profiled), GPU busy {busy:.2f}; "
              + ", ".join(f"{c} {v:.2f}" for c, v in k.items())
              + f"; wall / (gemm + attention) = {cb.wall_ms / max(k['gemm'] + k['attention'], 1e-9):.2f}x",
              flush=True)
        return
    print(f"\n######## {model} {name} ({prec})")
    cpu_total = sum(e.self_cpu_time_total for e in ka) / steps / 1e3
    aten = sum(e.count for e in ka if e.key.startswith("aten::")) / steps
    print(f"self CPU ms/step (profiled) {cpu_total:.2f}; aten calls/step {aten:.0f}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert")
    p.add_argument("--cases", default="mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--classes", action="store_true", help="one line per case: GPU time by kernel class")
    a = p.parse_args(argv)
    for name in a.cases.split(","):
        run(a.model, name, a.warmup, a.steps, a.rows, a.classes)


if __name__ == "__main__":
    sys.exit(main())
