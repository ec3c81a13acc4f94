"""Where the host time of an e2e step goes: cProfile over the timed steps of `mptrain bench e2e`
cases (lab tool, not shipped).  A host-bound step's wall time is its Python + dispatch time.

    python3 dev/host_profile_e2e.py --model bert --cases mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import lightning as L
import torch

from mptrain.bench import e2e
from mptrain.bench.e2e_models import build, compile_lightning_module, use_optimizer


class HostProfile(L.Callback):
    def __init__(self, warmup, steps):
        self.warmup, self.steps, self.n, self.prof, self.wall = warmup, steps, 0, cProfile.Profile(), None

    def on_train_batch_end(self, *a):
        self.n += 1
        if self.n == self.warmup:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            self.prof.enable()
        elif self.n == self.warmup + self.steps:
            self.prof.disable()
            torch.cuda.synchronize()
            self.wall = (time.perf_counter() - self.t0) / self.steps * 1e3


def run(model, name, warmup, steps, rows):
    name, _, mode = name.partition("@")  # "mptrain+compile:best@bf16-master": that mode for this "best" case
    spec = e2e.CASES[name]
    prec = (mode or "bf16-master") if spec.precision == "best" else spec.precision
    module, batches, _ = build(model, warmup + steps, "cuda", stock=spec.trainer == "lightning")
    use_optimizer(module, e2e.optimizer_factory(spec.optimizer))
    if spec.trainer == "lightning" and model == "resnet50":
        module = module.to(memory_format=torch.channels_last)
    if spec.trainer == "lightning" and spec.compile:
        module = compile_lightning_module(module)
    cb = HostProfile(warmup, steps)
    trainer = e2e._trainer(spec, prec, model, e2e.StepTimer(warmup, steps, sync_steps=0), warmup + steps, False)
    trainer.callbacks.append(cb)
    trainer.fit(module, train_dataloaders=batches)
    s = io.StringIO()
    st = pstats.Stats(cb.prof, stream=s)
    print(f"\n######## {model} {name} ({prec}): {cb.wall:.2f} ms/step under cProfile")
    st.sort_stats("tottime").print_stats(rows)
    st.sort_stats("cumtime").print_stats(rows)
    print(s.getvalue())


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert")
    p.add_argument("--cases", default="mptrain:bf16-master,lightning:bf16-true+FusedAdamW(master)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=45)
    a = p.parse_args(argv)
    for name in a.cases.split(","):
        run(a.model, name, a.warmup, a.steps, a.rows)


if __name__ == "__main__":
    sys.exit(main())
