"""Which scaled_dot_product_attention back end a user's transformers model gets, eager and compiled, and how fast
each back end is there (lab tool, not shipped).

    python3 dev/sdpa_choice.py --layers 2

For a BertForMaskedLM (train mode: attention dropout 0.1) at batch 128 x 128 and a LlamaForCausalLM at the 1.2B
widths (h2048, 16 heads of 128, causal) at batch 8 x 2048, both in bf16 with ``--layers`` layers: per priority
list (torch's default, then each back end first), eager and compiled, the forward + backward ms, the attention
kernels' ms and TFLOP/s (4 * b * h * s^2 * d per forward, 2.5x that for forward + backward; causal: half), and
the kernel names.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

ATTN = ("flash", "fmha", "attention", "sdpa", "cudnn", "efficient", "softmax")
ORDERS = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                  SDPBackend.MATH],
}


def build(kind, layers):
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM
    if kind == "bert":
        m = BertForMaskedLM(BertConfig(attn_implementation="sdpa", num_hidden_layers=layers))
        b, s, h, d, causal = 128, 128, 12, 64, False
        batch = dict(input_ids=torch.randint(0, 30522, (b, s), device="cuda"))
        batch["labels"] = batch["input_ids"].clone()
    else:
        m = LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                         num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                         max_position_embeddings=2048, attn_implementation="sdpa"))
        b, s, h, d, causal = 8, 2048, 16, 128, True
        batch = dict(input_ids=torch.randint(0, 32000, (b, s), device="cuda"))
        batch["labels"] = batch["input_ids"].clone()
    flops = 4 * b * h * s * s * d * 3.5 * layers * (0.5 if causal else 1.0)  # forward 1x + backward 2.5x
    return m.to("cuda", torch.bfloat16).train(), batch, flops


def step(model, batch):
    loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(kind, layers, order_name, compiled, masks="transformers", iters=6):
    from mptrain.nn.sdpa_masks import skip_trivial_masks

    torch._dynamo.reset()
    model, batch, flops = build(kind, layers)
    run = torch.compile(model) if compiled else model
    order = ORDERS[order_name]
    ctx = (lambda: sdpa_kernel(order, set_priority=True)) if order else contextlib.nullcontext
    mask_ctx = skip_trivial_masks if masks == "mptrain" else contextlib.nullcontext
    try:
        with ctx(), mask_ctx():
            for _ in range(3):
                step(run, batch)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                step(run, batch)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) * 1e3 / iters
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(2):
                    step(run, batch)
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a back end refusing the call is a result
        print(f"{kind} {order_name} {'compiled' if compiled else 'eager'} masks={masks}: {type(e).__name__}: "
              f"{str(e)[:200]}")
        return
    names = {}
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and any(f in e.key.lower() for f in ATTN):
            names[e.key] = names.get(e.key, 0.0) + getattr(e, "self_device_time_total", 0.0) / 2 / 1e3
    attn_ms = sum(names.values())
    print(f"{kind} layers={layers} {order_name:9s} {'compiled' if compiled else 'eager   '} masks={masks:12s}: "
          f"step {ms:7.2f} ms, "
          f"attention-ish kernels {attn_ms:6.2f} ms = {flops / max(attn_ms, 1e-9) / 1e9:6.1f} TFLOP/s", flush=True)
    for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:6]:
        print(f"      {v:7.3f} ms  {k[:110]}")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--models", default="bert,llama")
    p.add_argument("--orders", default="default,cudnn,flash,efficient")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--masks", default="transformers,mptrain", help="transformers: its own masks; mptrain: inside "
                                                                   "mptrain.nn.sdpa_masks.skip_trivial_masks()")
    a = p.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__)
    for kind in a.models.split(","):
        for order in a.orders.split(","):
            for mode in a.modes.split(","):
                for masks in a.masks.split(",") if mode == "compiled" else ["transformers"]:
                    measure(kind, a.layers, order, mode == "compiled", masks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
