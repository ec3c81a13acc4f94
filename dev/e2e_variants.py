"""Ablations of the BERT e2e step (lab tool, not shipped): which part of mptrain's step costs what.

    python3 dev/e2e_variants.py [--steps 20] [--profile] [--only REGEX] [--repeat N]

Each variant trains BERT-base MLM (batch 128, seq 128) on the e2e harness's device batches and
prints ms/step (wall, --steps after --warmup), and with --profile the GPU kernel time per step
(torch.profiler, separate short run).  Variants switch one thing at a time: the fp32 fallback
off, torch's LayerNorm instead of the fused one, Lightning's own Trainer with the same model, compile
with inductor's Python or C++ wrapper (`--only compile`).
"""
from __future__ import annotations

import argparse
import re
import sys
import time

import lightning as L
import torch

from mptrain.bench import e2e
from mptrain.bench.e2e_models import build, use_optimizer


class Window(L.Callback):
    def __init__(self, warmup, steps, profile):
        self.warmup, self.steps, self.n, self.profile = warmup, steps, 0, profile
        self.ms = self.gpu_ms = None

    def on_train_batch_end(self, *a):
        self.n += 1
        if self.n == self.warmup:
            torch.cuda.synchronize()
            if self.profile:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.n == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.ms = (time.perf_counter() - self.t0) * 1e3 / self.steps
            if self.profile:
                self.prof.__exit__(None, None, None)
                self.gpu_ms = sum(e.self_device_time_total for e in self.prof.key_averages()) / 1e3 / self.steps


VARIANTS = {
    # name: (trainer, precision, optimizer, stock model, mptrain trainer kwargs)
    "mptrain bf16-master": ("mptrain", "bf16-master", "mptrain", False, {}),
    "mptrain bf16-master, fallback off": ("mptrain", "bf16-master", "mptrain", False, {"fp32_fallback": []}),
    "mptrain bf16-master, torch LN": ("mptrain", "bf16-master", "mptrain", True, {}),
    "lightning bf16-true + FusedAdamW(master)": ("lightning", "bf16-true", "mptrain-master", True, {}),
    "lightning bf16-true + FusedAdamW(master), fused LN": ("lightning", "bf16-true", "mptrain-master", False, {}),
    "mptrain bf16-mixed": ("mptrain", "bf16-mixed", "mptrain", False, {}),
    "mptrain bf16-mixed, fallback off": ("mptrain", "bf16-mixed", "mptrain", False, {"fp32_fallback": []}),
    "mptrain bf16-mixed, torch LN": ("mptrain", "bf16-mixed", "mptrain", True, {}),
    "mptrain bf16-mixed, torch LN, torch AdamW": ("mptrain", "bf16-mixed", "torch-fused", True, {}),
    "lightning bf16-mixed": ("lightning", "bf16-mixed", "torch-fused", True, {}),
    "lightning bf16-mixed, fused LN": ("lightning", "bf16-mixed", "torch-fused", False, {}),
    "mptrain 16-mixed": ("mptrain", "16-mixed", "mptrain", False, {}),
    "mptrain 16-mixed, fallback off": ("mptrain", "16-mixed", "mptrain", False, {"fp32_fallback": []}),
    "mptrain 16-mixed, scaler off": ("mptrain", "16-mixed", "mptrain", False, {"loss_scaler": "off"}),
    "mptrain 16-mixed, torch LN, torch AdamW": ("mptrain", "16-mixed", "torch-fused", True, {}),
    "lightning 16-mixed": ("lightning", "16-mixed", "torch-fused", True, {}),
    "lightning 16-mixed, fused LN, FusedAdamW": ("lightning", "16-mixed", "mptrain", False, {}),
    # the compiled step is host-bound (Python launches ~650 kernels per step): inductor's C++ wrapper
    "mptrain bf16-master, compile": ("mptrain", "bf16-master", "mptrain", False, {"compile": True}),
    "mptrain bf16-master, compile cpp_wrapper": ("mptrain", "bf16-master", "mptrain", False,
                                                 {"compile": {"options": {"cpp_wrapper": True}}}),
    "mptrain 16-master": ("mptrain", "16-master", "mptrain", False, {}),
    "mptrain 16-master, compile": ("mptrain", "16-master", "mptrain", False, {"compile": True}),
    "mptrain 16-master, compile cpp_wrapper": ("mptrain", "16-master", "mptrain", False,
                                               {"compile": {"options": {"cpp_wrapper": True}}}),
}


def run(name, warmup, steps, profile):
    trainer_kind, precision, opt, stock, extra = VARIANTS[name]
    module, batches, _ = build("bert", warmup + steps, "cuda", stock=stock)
    use_optimizer(module, e2e.optimizer_factory(opt))
    win = Window(warmup, steps, profile)
    common = dict(accelerator="cuda", devices=1, max_steps=warmup + steps, max_epochs=1, logger=False,
                  enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0, benchmark=True, callbacks=[win])
    if trainer_kind == "lightning":
        trainer = L.Trainer(precision=precision, **common)
    else:
        from mptrain import Trainer

        trainer = Trainer(precision=precision, **extra, **common)
    trainer.fit(module, train_dataloaders=batches)
    return win


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="also the GPU kernel time per step (second run)")
    p.add_argument("--only", default="", help="the variants whose name matches this regex")
    p.add_argument("--repeat", type=int, default=1, help="passes over the variants, alternating their order")
    a = p.parse_args(argv)
    names = [n for n in VARIANTS if re.search(a.only, n)]
    rows = []
    for r in range(a.repeat):
        for name in names if r % 2 == 0 else names[::-1]:  # host drift moves every variant alike
            w = run(name, a.warmup, a.steps, False)
            g = run(name, a.warmup, 5, True).gpu_ms if a.profile else None
            rows.append((name, w.ms, g))
            print(f"[variant] {name}: {w.ms:.2f} ms/step" + (f", GPU kernels {g:.2f} ms/step" if g else ""), flush=True)
    rows.sort(key=lambda row: names.index(row[0]))
    print(f"\n{'variant':<52} {'ms/step':>8} {'GPU ms':>8}")
    for name, ms, g in rows:
        print(f"{name:<52} {ms:8.2f} {g if g is None else f'{g:8.2f}'}")


if __name__ == "__main__":
    sys.exit(main())
