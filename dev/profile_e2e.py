"""Profile a few steps of `mptrain bench e2e` cases with torch.profiler (lab tool, not shipped).

    python3 dev/profile_e2e.py --model bert --cases mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)

Per case: wall ms/step of the profiled window, then the top ops by self CPU time and by
self CUDA time, and the count of aten ops per step (host work is what a host-bound step pays).
`--classes` prints instead one line per case: GPU kernel time per step by class (GEMM,
attention, optimizer, other) against the wall time, i.e. how far a step is from its GEMM +
attention time (the most any change to the rest could gain).  `--diff` (two cases) prints the
ops whose count or self CPU / GPU time per step differs most between them.  A "best" case runs
bf16-master unless it names its mode: `--diff --cases
mptrain+compile:best@16-master,mptrain+compile:best@bf16-master`.  The first case a process
profiles pays one-off costs (profiler buffers, allocator growth): `--warm` profiles one case
first and discards it.
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


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def run(model, name, warmup, steps, rows, classes=False, quiet=False):
    name, _, mode = name.partition("@")  # "mptrain+compile:best@16-master": that mode for this "best" case
    spec = e2e.CASES[name]
    prec = (mode or "bf16-master") if spec.precision == "best" else spec.precision
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
    if quiet:
        return per_step(ka, steps), cb.wall_ms, prec
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
    launches = sum(e.count for e in ka if e.key in LAUNCHES) / steps
    print(f"wall {cb.wall_ms:.2f} ms/step (profiled); self CPU ms/step {cpu_total:.2f}; aten calls/step {aten:.0f}; "
          f"kernel launches/step {launches:.0f}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def per_step(ka, steps):
    """op -> (count, self CPU us, self GPU us) per step."""
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps,
                    getattr(e, "self_device_time_total", 0.0) / steps) for e in ka}


def diff(model, names, warmup, steps, rows):
    (a, wa, pa), (b, wb, pb) = (run(model, n, warmup, steps, rows, quiet=True) for n in names)
    for name, prec, wall, ops in ((names[0], pa, wa, a), (names[1], pb, wb, b)):
        launches = sum(ops.get(k, (0,))[0] for k in LAUNCHES)
        cpu_ms = sum(v[1] for v in ops.values()) / 1e3
        print(f"{name} ({prec}): wall {wall:.2f} ms/step (profiled), self CPU {cpu_ms:.2f} ms/step, "
              f"kernel launches/step {launches:.0f}")
    zero = (0.0, 0.0, 0.0)
    for title, col in (("self CPU", 1), ("self GPU", 2)):
        keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, zero)[col] - b.get(k, zero)[col]))[:rows]
        print(f"\nlargest {title} differences, per step: count A / B, self CPU us A / B, self GPU us A / B")
        for k in keys:
            x, y = a.get(k, zero), b.get(k, zero)
            print(f"{k[:60]:<60} {x[0]:7.1f} {y[0]:7.1f} {x[1]:8.0f} {y[1]:8.0f} {x[2]:8.0f} {y[2]:8.0f}")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert")
    p.add_argument("--cases", default="mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--classes", action="store_true", help="one line per case: GPU time by kernel class")
    p.add_argument("--diff", action="store_true", help="two cases: the ops that differ most between them")
    p.add_argument("--warm", action="store_true", help="profile one case first, untimed, and discard it")
    a = p.parse_args(argv)
    names = a.cases.split(",")
    if a.warm:
        run(a.model, names[0], a.warmup, a.steps, a.rows, quiet=True)
    if a.diff:
        if len(names) != 2:
            p.error(f"--diff compares two cases; got {len(names)}")
        diff(a.model, names, a.warmup, a.steps, a.rows)
        return 0
    for name in names:
        run(a.model, name, a.warmup, a.steps, a.rows, a.classes)


if __name__ == "__main__":
    sys.exit(main())
