"""Profile a few steps of `mptrain bench e2e` cases with torch.profiler (lab tool, not shipped).

    python3 dev/profile_e2e.py --model bert --cases mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)

Per case: wall ms/step of the profiled window, then the top ops by self CPU time and by
self CUDA time, and the count of aten ops per step (host work is what a host-bound step pays).
"""
from __future__ import annotations

import argparse
import sys

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from mptrain.bench import e2e
from mptrain.bench.e2e_models import build, compile_lightning_module, use_optimizer


class Prof(L.Callback):
    def __init__(self, warmup, steps):
        self.warmup, self.steps, self.n, self.prof = warmup, steps, 0, None

    def on_train_batch_end(self, *a):
        self.n += 1
        if self.n == self.warmup:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False)
            self.prof.__enter__()
        elif self.n == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)


def run(model, name, warmup, steps, rows):
    spec = e2e.CASES[name]
    prec = "bf16-master" if spec.precision == "best" else spec.precision
    module, batches, _ = build(model, warmup + steps, "cuda", stock=spec.trainer == "lightning")
    use_optimizer(module, e2e.optimizer_factory(spec.optimizer))
    if spec.trainer == "lightning" and model == "resnet50":
        module = module.to(memory_format=torch.channels_last)
    if spec.trainer == "lightning" and spec.compile:
        module = compile_lightning_module(module)
    cb = Prof(warmup, steps)
    timer = e2e.StepTimer(warmup, steps)
    trainer = e2e._trainer(spec, prec, model, timer, warmup + steps, False)
    trainer.callbacks.append(cb)
    trainer.fit(module, train_dataloaders=batches)
    ka = cb.prof.key_averages()
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
    a = p.parse_args(argv)
    for name in a.cases.split(","):
        run(a.model, name, a.warmup, a.steps, a.rows)


if __name__ == "__main__":
    sys.exit(main())
