"""Where the time of a compiled Llama training step goes, per precision case (lab tool, not shipped).

Runs mptrain.Trainer on transformers' LlamaForCausalLM (synthetic tokens), times the steps with CUDA events
and profiles a few of them, summing GPU kernel time by category (fp8 GEMM, bf16 GEMM, attention, casts and
amax, optimizer, other).  Cases: bf16-master; torchao tensorwise swapped inside bf16-master; fp8-master;
fp8-master-delayed (recipe="delayed": casts fused into the kernels that produce their tensors, so those kernels
count as casts here); blockwise (the linears but lm_head as ``dev/fp8_blockwise.py``'s 1x128 / 128x128 scaled
linear, inside bf16-master).

    python dev/fp8_llama_profile.py --config 1b --cases bf16-master,torchao,fp8-master
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import time

import lightning as L
import torch
import torch.nn.functional as F

CONFIGS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=16, batch=8),
    "8b_layers": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                      num_key_value_heads=8, batch=4),
}
SEQ, VOCAB = 2048, 32000


class LM(L.LightningModule):
    def __init__(self, cfg, swap: str | None):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        c = {k: v for k, v in cfg.items() if k != "batch"}
        conf = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation="sdpa", **c)
        with torch.device("cuda"):
            self.model = LlamaForCausalLM(conf)
        if swap == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(self.model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                       module_filter_fn=lambda m, fqn: fqn != "lm_head")
        elif swap == "blockwise":
            from fp8_blockwise import check_blockwise, use_blockwise  # dev/, beside this script
            check_blockwise("cuda")
            use_blockwise(self.model, skip=("lm_head",))

    def training_step(self, batch, _):
        logits = self.model(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class Probe(L.Callback):
    def __init__(self, warmup, steps, prof_steps):
        self.warmup, self.steps, self.prof_steps = warmup, steps, prof_steps
        self.n, self.ev, self.prof, self.ms = 0, None, None, None

    def on_train_batch_end(self, trainer, pl_module, *a):
        self.n += 1
        if self.n == self.warmup:
            torch.cuda.synchronize()
            self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.ev[0].record()
        elif self.n == self.warmup + self.steps:
            self.ev[1].record()
            torch.cuda.synchronize()
            self.ms = self.ev[0].elapsed_time(self.ev[1]) / self.steps
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.n == self.warmup + self.steps + self.prof_steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)


class Batches:
    """An iterable of device batches (a plain list would be taken as several loaders)."""

    def __init__(self, data, n):
        self.data, self.n = data, n

    def __len__(self):
        return self.n

    def __iter__(self):
        return (self.data[i % len(self.data)] for i in range(self.n))


def category(name: str) -> str:
    """The issue's columns: GEMMs (fp8 / bf16), attention, fp8 casts and amax, norms, optimizer, other."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n or "cudnn" in n and "mha" in n:
        return "attention"
    # cuBLAS's nvjet kernels name fp8 operands with q: "qqtst" (both fp8), "qrtst" (fp8 x row-scaled)
    if n.startswith("nvjet") and ("_qq" in n or "_qr" in n) or "e4m3" in n or "e5m2" in n:
        return "fp8 gemm"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n or "sm90_" in n:
        return "bf16 gemm"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    if "triton" in n:
        # inductor names a kernel after the ops it fused: an fp8 cast clamps to the format's range, an amax
        # reduces abs values; a norm takes a mean of squares (RMSNorm) or a variance (LayerNorm) and a rsqrt
        if "amax" in n or "clamp" in n or "float8" in n:
            return "fp8 casts and amax (inductor)"
        if "rsqrt" in n or "var_mean" in n:
            return "norms (inductor)"
        return "other inductor kernels (RoPE, SiLU x mul, residuals, loss)"
    return "other"


def attention_tflop(cfg: dict) -> float:
    """Causal attention's matmul work of one step, forward and backward (TFLOP): 4 B S^2 H D forward, halved by
    the causal mask, times 3.5 (backward: 2.5x forward)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg["hidden_size"] // heads
    fwd = 4 * cfg["batch"] * SEQ * SEQ * heads * head_dim / 2
    return 3.5 * fwd * cfg["num_hidden_layers"] / 1e12


def run(case: str, cfg: dict, warmup: int, steps: int, prof_steps: int, fused) -> dict:
    from mptrain import Trainer
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = LM(cfg, swap=case if case in ("torchao", "blockwise") else None)
    g = torch.Generator(device="cuda").manual_seed(0)
    data = [torch.randint(0, VOCAB, (cfg["batch"], SEQ), device="cuda", generator=g) for _ in range(4)]
    total = warmup + steps + prof_steps + 1
    loader = Batches(data, total)
    probe = Probe(warmup, steps, prof_steps)
    if case == "fp8-master-delayed":  # casts at scales from the amax history (mptrain.precision.fp8_delayed)
        from mptrain import Fp8Precision
        mode = dict(plugins=[Fp8Precision(recipe="delayed", fused=fused)])
    else:
        mode = dict(precision="fp8-master" if case == "fp8-master" else "bf16-master", fused=fused)
    trainer = Trainer(**mode, compile=True, max_steps=total, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    t = time.perf_counter()
    trainer.fit(model, loader)
    cats = collections.Counter()
    top = collections.Counter()
    for e in probe.prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.self_device_time_total / prof_steps / 1e3
            cats[category(e.key)] += us
            top[e.key[:90]] += us
    att = cats.get("attention")
    out = dict(case=case, ms=probe.ms, peak_gb=torch.cuda.max_memory_allocated() / 1e9,
               attention_tflops=attention_tflop(cfg) / (att / 1e3) if att else None,
               wall_s=time.perf_counter() - t, categories_ms=dict(cats.most_common()),
               top_ms=dict(top.most_common(25)))
    del trainer, model, data, loader
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="1b", choices=list(CONFIGS))
    p.add_argument("--cases", default="bf16-master,torchao,fp8-master")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prof-steps", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--fused", default="off", choices=("auto", "off"),
                   help="the Trainer's fused= (auto: mptrain's one-pass master AdamW, as mptrain.bench.fp8 runs)")
    a = p.parse_args()
    results = []
    for case in a.cases.split(","):
        try:
            r = run(case, CONFIGS[a.config], a.warmup, a.steps, a.prof_steps, "auto" if a.fused == "auto" else False)
        except Exception as e:  # a lab tool: record and go on to the next case
            r = dict(case=case, error=f"{type(e).__name__}: {e}"[:2000])
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    base = next((r["ms"] for r in results if r.get("case") == "bf16-master" and "ms" in r), None)
    for r in results:
        if "ms" in r:
            print(f"{a.config} {r['case']:>12}: {r['ms']:.1f} ms/step  peak {r['peak_gb']:.1f} GB  "
                  + "  ".join(f"{k} {v:.1f}" for k, v in r["categories_ms"].items())
                  + (f"  attention {r['attention_tflops']:.0f} TFLOP/s" if r.get("attention_tflops") else "")
                  + (f"  {base / r['ms']:.3f}x bf16-master" if base else ""))
    if a.out:
        json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
