"""Profile the user-model cases of ``mptrain bench e2e`` (lab tool, not shipped): where a compiled step's time
goes, against Lightning + torch.compile on the same model in the same process.

    python3 dev/profile_user.py --model user_bert \
        --cases "lightning+compile:bf16-mixed,mptrain:bf16-master,mptrain+compile:bf16-master,mptrain+compile:bf16-master|fp32_fallback=[]"

A case is a name of ``e2e.USER_CASES``, optionally followed by ``|key=value`` mptrain Trainer arguments (values
parsed as Python literals).  Per case: wall ms/step of the profiled window, GPU time per step by kernel class,
dynamo's graph / graph-break / recompile counts, the peak memory, and the top GPU kernels; ``--diff A,B``
(indices into --cases) prints the kernels whose time per step differs most between two cases.
"""
from __future__ import annotations

import argparse
import ast
import gc
import sys
import time

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from mptrain.bench import e2e
from mptrain.bench.e2e_models import make_trainer

CLASSES = {
    "gemm": ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "sm90_", "sm100_"),
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn_generated", "efficient"),
    "optimizer": ("multi_tensor", "adam", "fused_adamw", "mptrain"),
    "triton": ("triton_",),
}


class Prof(L.Callback):
    """Steps warmup..warmup+timed timed without the profiler (the step as a user runs it), then ``steps`` profiled."""

    def __init__(self, warmup, steps, timed):
        self.warmup, self.steps, self.timed, self.n, self.prof, self.wall_ms = warmup, steps, timed, 0, None, 0.0

    def on_train_batch_end(self, *a):
        self.n += 1
        start = self.warmup + self.timed
        if self.n == self.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.t_plain = time.perf_counter()
        elif self.n == start:
            torch.cuda.synchronize()
            self.plain_ms = (time.perf_counter() - self.t_plain) * 1e3 / self.timed
            self.peak_gb = torch.cuda.max_memory_allocated() / 2**30
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.n == start + self.steps:
            torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3 / self.steps
            self.prof.__exit__(None, None, None)


def parse_case(text):
    name, *opts = text.split("|")
    extra = {}
    for o in opts:
        k, _, v = o.partition("=")
        extra[k] = ast.literal_eval(v)
    return name, extra


def kernel_times(ka, steps):
    out = {}
    for e in ka:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.key.startswith(("Optimizer.", "ProfilerStep")):
            continue
        t = getattr(e, "self_device_time_total", 0.0)
        out[e.key] = out.get(e.key, 0.0) + t / steps / 1e3
    return out


def classify(kt):
    out = dict.fromkeys([*CLASSES, "other"], 0.0)
    for k, t in kt.items():
        name = k.lower()
        cls = next((c for c, frags in CLASSES.items() if any(f in name for f in frags)), "other")
        out[cls] += t
    return out


def gemm_shapes(prof, steps, rows=12):
    """The matmul calls by input shapes, with their GPU time per step: which layer a GEMM kernel belongs to."""
    out = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::linear"):
            t = getattr(e, "device_time_total", 0.0) / steps / 1e3
            out.append((t, e.key, e.count // steps, e.input_shapes))
    for t, key, n, shapes in sorted(out, key=lambda r: -r[0])[:rows]:
        print(f"  {t:8.3f} ms  {key} x{n} {shapes}")


def run(model, text, warmup, steps, rows, timed=10):
    name, extra = parse_case(text)
    spec = e2e.USER_CASES[name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gc.collect()
    torch.cuda.empty_cache()
    total = warmup + timed + steps + 1
    module, batches, _ = e2e._build(model, spec, total, False)
    prof = Prof(warmup, steps, timed)
    ours = dict(channels_last=model == "user_resnet50", cuda_graphs=spec.cuda_graphs, compile=bool(spec.compile))
    ours.update(extra)
    trainer = make_trainer(spec.trainer, spec.precision, [prof], total, ours, accelerator="cuda",
                           devices=1, benchmark=True)
    trainer.fit(module, train_dataloaders=batches)
    c = torch._dynamo.utils.counters
    breaks = sum(c["graph_break"].values())
    graphs = c["stats"].get("unique_graphs", 0)
    kt = kernel_times(prof.prof.key_averages(), steps)
    cls = classify(kt)
    print(f"\n######## {model} {text}: {prof.plain_ms:.2f} ms/step unprofiled; {prof.wall_ms:.2f} profiled, GPU busy {sum(kt.values()):.2f}, "
          + ", ".join(f"{k} {v:.2f}" for k, v in cls.items())
          + f"; peak {prof.peak_gb:.2f} GB; dynamo graphs {graphs}, graph breaks {breaks}, kernels/step "
          f"{sum(1 for _ in kt)}", flush=True)
    if breaks:
        for reason, n in list(c["graph_break"].items())[:10]:
            print(f"  graph break x{n}: {reason[:200]}")
    for k, t in sorted(kt.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {t:8.3f} ms  {k[:110]}")
    gemm_shapes(prof.prof, steps)
    module = trainer = batches = None
    return kt, prof.wall_ms


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="user_bert")
    p.add_argument("--cases", default="lightning+compile:bf16-mixed,mptrain:bf16-master,mptrain+compile:bf16-master")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--diff", default="", help="pairs of case indices, e.g. 0:2,1:2")
    a = p.parse_args(argv)
    texts = a.cases.split(",")
    results = [run(a.model, t, a.warmup, a.steps, a.rows) for t in texts]
    for pair in filter(None, a.diff.split(",")):
        i, j = map(int, pair.split(":"))
        (ka, wa), (kb, wb) = results[i], results[j]
        print(f"\n==== diff {texts[i]} ({wa:.2f} ms) vs {texts[j]} ({wb:.2f} ms): kernel ms/step A, B, B-A")
        keys = sorted(set(ka) | set(kb), key=lambda k: -abs(kb.get(k, 0) - ka.get(k, 0)))[:a.rows]
        for k in keys:
            x, y = ka.get(k, 0.0), kb.get(k, 0.0)
            print(f"  {x:8.3f} {y:8.3f} {y - x:+8.3f}  {k[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
