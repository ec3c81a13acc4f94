"""Do delayed fp8 scales let inductor fuse the casts into their producers?  One Llama MLP block, compiled (lab tool).

A transformers ``LlamaRMSNorm`` + ``LlamaMLP`` at the 1.2B recipe's widths (hidden 2048, FFN 8192, 8 x 2048
tokens), forward and backward, compiled, in these variants:

  bf16        the block in bf16
  tensorwise  its linears as fp8-master's ``Fp8Linear`` (current scales: an amax pass, then a cast pass)
  delayed     the same as ``DelayedFp8Linear`` with a history (``recipe="delayed"``: casts at known scales)
  delayed-fused
              the delayed layers with the MLP as one function whose SiLU x mul writes its fp8 operands and their
              amaxes in one pass each way (``mptrain.precision.fp8_mlp``: what ``recipe="delayed"`` runs)
  delayed-fp8amax  the delayed linear with each recorded amax read from the fp8 operand it cast (1 byte an
              element; inductor otherwise recomputes the SiLU x mul or its backward in a reduction of its own), a
              saturated operand recorded at twice its scale's range so that the history catches up
  tensorwise-wholeamax, delayed-wholeamax
              the same with each amax one reduction over the whole tensor (``x.abs().amax()``) instead of the
              product's row-first one (``fp8_linear.tensor_amax``: along the contiguous dimension, then over those
              maxima; the same value): a whole-tensor reduction is a split reduction of its own that recomputes the
              producer, a reduction along rows has the producer's loop shape and fuses into its kernel
  blockwise   DeepSeek-V3's scales: activations and gradients in 1x128 tiles along the contraction dimension,
              weights in 128x128 blocks (``torch.nn.functional.scaled_mm``'s ``BlockWise1x128`` and
              ``BlockWise128x128``: cuBLAS on Hopper, CUDA 12.9 or newer).  Each tile's scale is a reduction
              over 128 neighbouring elements: no cast waits for a whole tensor.  The input and the output
              gradient are cast twice (along the features for the forward and input-gradient GEMMs, along the
              tokens, transposed, for the weight-gradient GEMM); the weight once, its blocks transposed for the
              input gradient (``dev/fp8_blockwise.py``).

Per variant: ms per forward + backward (CUDA events, median of --steps), the number of GPU kernels per step and
the kernels' time by name (profiler).  The full model's answer costs a 1.2B compile per case (over a minute each on
an H100); this block compiles in seconds.  ``--device cpu --small`` checks the harness on the CPU (torch runs fp8
``_scaled_mm`` there).

    python3 dev/fp8_mlp_fusion.py                       # on the GPU machine, about a minute
    python3 dev/fp8_mlp_fusion.py --device cpu --small  # the harness
"""
from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn)
        self.norm = LlamaRMSNorm(hidden)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Fp8AmaxMatmul(torch.autograd.Function):
    """``_DelayedFp8Matmul`` with the amaxes taken from the fp8 operands (the variant ``delayed-fp8amax``): the
    input's comes back as a second, non-differentiable output, the output gradient's through the sink."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, input_scale, grad_scale, grad_amax_sink, mm_config, config):
        from mptrain.precision import fp8_linear

        T = fp8_linear.torchao_linear
        shape = input_hp.shape
        x = fp8_linear.cast_with_scale(input_hp.reshape(-1, shape[-1]), input_scale,
                                       config.cast_config_input.target_dtype, mm_config, T.GemmInputRole.INPUT)
        w_t = fp8_linear._cast(T, weight_hp.t(), config.cast_config_weight.target_dtype, mm_config,
                               T.GemmInputRole.WEIGHT)
        ctx.save_for_backward(x, w_t, grad_scale)
        ctx.mm_config, ctx.config, ctx.input_shape = mm_config, config, shape
        out = torch.mm(x, w_t)
        amax = _fp8_amax(x._data, input_scale)
        ctx.mark_non_differentiable(amax)
        return out.reshape(*shape[:-1], out.shape[-1]), amax

    @staticmethod
    def backward(ctx, grad_output, _):
        from mptrain.precision import fp8_linear

        T = fp8_linear.torchao_linear
        x, w_t, grad_scale = ctx.saved_tensors
        g = fp8_linear.cast_with_scale(grad_output.reshape(-1, grad_output.shape[-1]), grad_scale,
                                       ctx.config.cast_config_grad_output.target_dtype, ctx.mm_config,
                                       T.GemmInputRole.GRAD_OUTPUT)
        grad_input = torch.mm(g, w_t.t()).reshape(*ctx.input_shape[:-1], -1) if ctx.needs_input_grad[0] else None
        grad_weight = torch.mm(g.t(), x) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None, None, _fp8_amax(g._data, grad_scale), None, None


def _fp8_amax(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The amax of a cast tensor from its fp8 bytes; a saturated cast (its largest value at the format's maximum)
    reports twice its scale's range: the true amax is beyond what the fp8 bytes can tell."""
    top = data.float().abs().amax()
    top = torch.where(top >= torch.finfo(data.dtype).max, 2 * top, top)
    return top / scale


def _fp8_amax_forward(self, input):
    """``DelayedFp8Linear.forward`` once the history exists, the input's amax from ``_Fp8AmaxMatmul``."""
    if not self.fp8_ready:
        return type(self).__mro__[1].forward(self, input)
    out, amax = _Fp8AmaxMatmul.apply(input, self.weight, self.fp8_input_scale, self.fp8_grad_scale,
                                     self.fp8_grad_amax, self.linear_mm_config, self.config)
    if torch.is_grad_enabled():
        self.fp8_input_amax.copy_(torch.maximum(self.fp8_input_amax, amax))
    return out if self.bias is None else out + self.bias.to(out.dtype)


def _whole_amax(x: torch.Tensor) -> torch.Tensor:
    """The amax as one reduction over the whole tensor (what the product's row-first ``tensor_amax`` replaced)."""
    return x.detach().abs().amax().float()


def _patch_whole_amax(on: bool) -> None:
    """The wholeamax variants: the product's row-first amax swapped for the whole-tensor one (or put back)."""
    from mptrain.precision import fp8_delayed, fp8_linear, fp8_mlp

    saved = _patch_whole_amax.__dict__.setdefault("saved", fp8_linear.tensor_amax)
    for mod in (fp8_linear, fp8_delayed, fp8_mlp):
        mod.tensor_amax = _whole_amax if on else saved


def build(variant: str, hidden: int, ffn: int, device: str):
    torch.manual_seed(0)
    block = Block(hidden, ffn).to(device, torch.bfloat16)
    scaling = None
    if variant == "blockwise":
        from fp8_blockwise import check_blockwise, use_blockwise  # dev/, beside this script

        check_blockwise(device)
        use_blockwise(block)
    elif variant != "bf16":
        import torchao.float8 as float8

        from mptrain.precision.fp8_delayed import use_delayed_scaling
        from mptrain.precision.fp8_linear import use_single_casts

        float8.convert_to_float8_training(block, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
        use_single_casts(block)
        _patch_whole_amax(variant.endswith("-wholeamax"))
        if variant.startswith("delayed"):
            scaling = use_delayed_scaling(block, torch.device(device))
        if variant == "delayed-fused":
            from mptrain.precision.fp8_mlp import use_fused_mlps

            assert use_fused_mlps(block) == ["mlp"]
        if variant == "delayed-fp8amax":
            cls = type(scaling.layers[0])
            variant_cls = type("Fp8AmaxDelayedLinear", (cls,), {"forward": _fp8_amax_forward})
            for m in scaling.layers:
                m.__class__ = variant_cls
    return block, scaling


def step(model, x):
    y = model(x)
    y.backward(torch.ones_like(y))


def run(variant: str, args) -> dict:
    torch._dynamo.reset()
    block, scaling = build(variant, args.hidden, args.ffn, args.device)
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    if scaling is not None:  # the plugin's first step: current scales, eagerly; then the history is there
        step(block, x)
        scaling.update()
    compiled = torch.compile(block)
    for _ in range(3):
        step(compiled, x)
    cuda = args.device == "cuda"
    times = []
    for _ in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(compiled, x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            t = time.perf_counter()
            step(compiled, x)
            times.append((time.perf_counter() - t) * 1e3)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(2):
            step(compiled, x)
        if cuda:
            torch.cuda.synchronize()
    kernels = collections.Counter()
    count = 0
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 2 / 1e3
        kernels[e.key[:100]] += t
        count += e.count / 2
    return dict(variant=variant, ms=statistics.median(times), kernels_per_step=count, top=kernels.most_common(12))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="hidden 64, FFN 256, 512 tokens")
    p.add_argument("--variants", default="bf16,tensorwise,tensorwise-wholeamax,delayed,delayed-wholeamax,"
                                         "delayed-fp8amax,delayed-fused,blockwise")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    args.hidden, args.ffn, args.tokens = (64, 256, 512) if args.small else (2048, 8192, 8 * 2048)
    results = []
    for v in args.variants.split(","):
        try:
            results.append(run(v, args))
        except Exception as e:  # one variant this torch or GPU cannot run: the others are still measured
            print(f"\n{v}: failed: {type(e).__name__}: {str(e)[:600]}")
    for r in results:
        print(f"\n{r['variant']}: {r['ms']:.3f} ms forward + backward, {r['kernels_per_step']:.0f} kernels a step")
        for name, ms in r["top"]:
            print(f"  {ms:8.3f} ms  {name}")
    base = {r["variant"]: r["ms"] for r in results}
    if "bf16" in base:
        print("\n" + ", ".join(f"{v} {base['bf16'] / ms:.3f}x bf16" for v, ms in base.items()))


if __name__ == "__main__":
    main()
