"""A Llama MLP whose SiLU x mul writes fp8, forward and backward, in one pass each (lab: not shipped).

Under the delayed recipe (``mptrain.precision.fp8_delayed``) the scale of every activation and output-gradient cast
is known before the step, so a cast is a pointwise function of its producer.  Inductor fuses the casts into the
SiLU x mul and its backward, but on an H100 it computes the amaxes that the next steps' scales need in reductions of
their own that recompute the SiLU x mul (0.27 ms) and its backward (0.39 ms) at the 1.2B widths, and it writes the
transposed copies that the weight-gradient GEMMs take in further kernels (docs/fp8.md).  Here two Triton kernels do
each direction in one pass over the bf16 operands:

- forward: ``h = silu(g) * u`` cast to e4m3 at the down projection's input scale, and ``amax(|h|)``;
- backward: ``dg`` and ``du`` from ``dh``, each cast to e5m2 at the gate and up projections' output-gradient scales,
  written row-major (the input-gradient GEMM's operand) and transposed (the weight-gradient GEMM's), with their
  amaxes.

The MLP's three GEMMs, the casts and the SwiGLU run in one autograd function (:class:`_FusedFp8MLP`), so the fp8
gradients go from the SwiGLU's backward to the gate and up GEMMs without a bf16 copy.  Amaxes reach the delayed
layers' state as the recipe's own do: the forward's are copied into the layers' running maxima, the backward's come
back as the gradients of the layers' sinks.  The kernels are opaque custom ops (``torch.library.custom_op`` with
fake implementations): ``torch.compile`` keeps them in its graph and calls them as they are.  ``TRITON_INTERPRET=1`` runs them on the CPU (the tests in ``check``).

    TRITON_INTERPRET=1 python3 dev/fp8_swiglu.py      # the kernels and the MLP against their references, CPU
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import custom_op

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_BM, _BN = 64, 64


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, scale_ptr, amax_ptr, M, N, FP8_MAX: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    s = tl.load(scale_ptr)
    tl.store(h_ptr + offs, tl.clamp(h * s, -FP8_MAX, FP8_MAX).to(h_ptr.dtype.element_ty), mask=mask)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(h), axis=1), axis=0))


@triton.jit
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, dgt_ptr, dut_ptr, sg_ptr, su_ptr, amax_g_ptr,
                       amax_u_ptr, M, N, FP8_MAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    du = dh * g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    dg8 = tl.clamp(dg * tl.load(sg_ptr), -FP8_MAX, FP8_MAX)
    du8 = tl.clamp(du * tl.load(su_ptr), -FP8_MAX, FP8_MAX)
    tl.store(dg_ptr + offs, dg8.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du8.to(du_ptr.dtype.element_ty), mask=mask)
    # the transposed copies (N x M, row-major): the tile transposed so that the stores run along M
    offs_t = cols[:, None] * M + rows[None, :]
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(dgt_ptr + offs_t, tl.trans(dg8).to(dgt_ptr.dtype.element_ty), mask=mask_t)
    tl.store(dut_ptr + offs_t, tl.trans(du8).to(dut_ptr.dtype.element_ty), mask=mask_t)
    tl.atomic_max(amax_g_ptr, tl.max(tl.max(tl.abs(dg), axis=1), axis=0))
    tl.atomic_max(amax_u_ptr, tl.max(tl.max(tl.abs(du), axis=1), axis=0))


def _grid(m: int, n: int):
    return (triton.cdiv(m, _BM), triton.cdiv(n, _BN))


@custom_op("mptrain_lab::swiglu_fp8", mutates_args=())
def swiglu_fp8(g: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(g) * u) * scale`` as e4m3 (saturated) and ``amax(|silu(g) * u|)`` (fp32, 0-d); g, u: (M, N)."""
    m, n = g.shape
    h = torch.empty((m, n), device=g.device, dtype=_E4M3)
    amax = torch.zeros((), device=g.device, dtype=torch.float32)
    _swiglu_fwd_kernel[_grid(m, n)](g, u, h, scale, amax, m, n, FP8_MAX=torch.finfo(_E4M3).max,
                                                 BM=_BM, BN=_BN)
    return h, amax


@custom_op("mptrain_lab::swiglu_fp8_backward", mutates_args=())
def swiglu_fp8_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, scale_g: torch.Tensor,
                        scale_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor]:
    """The gradients of ``silu(g) * u`` with respect to g and u for ``dh``, each as e5m2 at its scale, row-major
    (M, N) and transposed (N, M), and their amaxes: ``(dg, du, dg_t, du_t, amax_dg, amax_du)``."""
    m, n = g.shape
    dg, du = (torch.empty((m, n), device=g.device, dtype=_E5M2) for _ in range(2))
    dg_t, du_t = (torch.empty((n, m), device=g.device, dtype=_E5M2) for _ in range(2))
    amax_g, amax_u = (torch.zeros((), device=g.device, dtype=torch.float32) for _ in range(2))
    _swiglu_bwd_kernel[_grid(m, n)](dh, g, u, dg, du, dg_t, du_t, scale_g, scale_u, amax_g, amax_u,
                                                 m, n, FP8_MAX=torch.finfo(_E5M2).max, BM=_BM, BN=_BN)
    return dg, du, dg_t, du_t, amax_g, amax_u


@swiglu_fp8.register_fake
def _(g, u, scale):
    return g.new_empty(g.shape, dtype=_E4M3), g.new_empty((), dtype=torch.float32)


@swiglu_fp8_backward.register_fake
def _(dh, g, u, scale_g, scale_u):
    m, n = g.shape
    return (*(g.new_empty((m, n), dtype=_E5M2) for _ in range(2)), *(g.new_empty((n, m), dtype=_E5M2) for _ in range(2)),
            *(g.new_empty((), dtype=torch.float32) for _ in range(2)))


def swiglu_fp8_reference(g, u, scale):
    h = torch.nn.functional.silu(g.float()) * u.float()
    return (h * scale).clamp(-448.0, 448.0).to(_E4M3), h.abs().amax()


def swiglu_fp8_backward_reference(dh, g, u, scale_g, scale_u):
    g32, u32, dh32 = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(g32)
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))
    du = dh32 * g32 * sig
    top = torch.finfo(_E5M2).max
    dg8, du8 = (dg * scale_g).clamp(-top, top).to(_E5M2), (du * scale_u).clamp(-top, top).to(_E5M2)
    return dg8, du8, dg8.t().contiguous(), du8.t().contiguous(), dg.abs().amax(), du.abs().amax()


#: what the fused MLP calls; ``check_mlp`` on the CPU swaps in the references (Triton's interpreter converts to fp8
#: with faults of its own, ``check``)
_KERNELS = {"forward": swiglu_fp8, "backward": swiglu_fp8_backward}


def _swiglu_fp8_eager_rounding(g, u, scale):
    """:func:`swiglu_fp8_reference` with eager autograd's bf16 roundings (the unfused layers' SiLU x mul)."""
    h = (torch.nn.functional.silu(g) * u).float()
    return (h * scale).clamp(-448.0, 448.0).to(_E4M3), h.abs().amax()


def _swiglu_fp8_backward_eager_rounding(dh, g, u, scale_g, scale_u):
    with torch.enable_grad():
        g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
        dg, du = torch.autograd.grad(torch.nn.functional.silu(g) * u, (g, u), dh)
    top = torch.finfo(_E5M2).max
    dg8, du8 = ((d.float() * s).clamp(-top, top).to(_E5M2) for d, s in ((dg, scale_g), (du, scale_u)))
    return dg8, du8, dg8.t().contiguous(), du8.t().contiguous(), dg.float().abs().amax(), du.float().abs().amax()


class _FusedFp8MLP(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` for the delayed recipe's three layers, their GEMMs in fp8: x cast once for
    gate and up (their shared input scale), h cast by the SwiGLU kernel, the output gradient cast once for the down
    projection's two GEMMs, the SwiGLU's input gradients cast by its backward kernel."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, x_scale, h_scale, gy_scale, gg_scale, gu_scale,
                sink_gy, sink_gg, sink_gu, mm_config, config):
        from mptrain.precision import fp8_delayed, fp8_linear

        T = fp8_linear.torchao_linear
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        shape = x.shape
        x8 = fp8_delayed._cast_with_scale(x.reshape(-1, shape[-1]), x_scale, config.cast_config_input.target_dtype,
                                          mm_config, T.GemmInputRole.INPUT)
        wdt = config.cast_config_weight.target_dtype
        wg_t, wu_t, wd_t = (fp8_linear._cast(T, w.t(), wdt, mm_config, T.GemmInputRole.WEIGHT)
                            for w in (w_gate, w_up, w_down))
        g, u = torch.mm(x8, wg_t), torch.mm(x8, wu_t)
        h_data, h_amax = _KERNELS["forward"](g, u, h_scale)
        h8 = Float8TrainingTensor(h_data, h_scale, x.dtype, mm_config, T.GemmInputRole.INPUT)
        y = torch.mm(h8, wd_t)
        ctx.save_for_backward(x8, wg_t, wu_t, wd_t, g, u, h8, gy_scale, gg_scale, gu_scale)
        ctx.mm_config, ctx.config, ctx.shape = mm_config, config, shape
        ctx.mark_non_differentiable(h_amax)
        return y.reshape(*shape[:-1], -1), h_amax

    @staticmethod
    def backward(ctx, grad_y, _):
        from mptrain.precision import fp8_delayed, fp8_linear

        T = fp8_linear.torchao_linear
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        x8, wg_t, wu_t, wd_t, g, u, h8, gy_scale, gg_scale, gu_scale = ctx.saved_tensors
        gy_hp = grad_y.reshape(-1, grad_y.shape[-1])
        gy = fp8_delayed._cast_with_scale(gy_hp, gy_scale, ctx.config.cast_config_grad_output.target_dtype,
                                          ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)
        dh = torch.mm(gy, wd_t.t())
        grad_wd = torch.mm(gy.t(), h8)
        dg, du, dg_t, du_t, amax_g, amax_u = _KERNELS["backward"](dh, g, u, gg_scale, gu_scale)

        def f8(data, scale):
            return Float8TrainingTensor(data, scale, grad_y.dtype, ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)

        grad_x = torch.mm(f8(dg, gg_scale), wg_t.t()) + torch.mm(f8(du, gu_scale), wu_t.t())
        grad_wg = torch.mm(f8(dg_t, gg_scale), x8)
        grad_wu = torch.mm(f8(du_t, gu_scale), x8)
        return (grad_x.reshape(ctx.shape), grad_wg, grad_wu, grad_wd, None, None, None, None, None,
                fp8_delayed._amax(gy_hp), amax_g, amax_u, None, None)


def fused_mlp_forward(self, x):
    """``LlamaMLP.forward`` over three ``DelayedFp8Linear`` layers (``use_fused_mlp``); the first step (no history
    yet) runs the layers as they are."""
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if not gate.fp8_ready:
        return down(self.act_fn(gate(x)) * up(x))
    from mptrain.precision import fp8_delayed

    training = torch.is_grad_enabled()
    if training:
        amax = torch.maximum(gate.fp8_input_amax, fp8_delayed._amax(x))
        gate.fp8_input_amax.copy_(amax)
        up.fp8_input_amax.copy_(torch.maximum(up.fp8_input_amax, amax))
    y, h_amax = _FusedFp8MLP.apply(x, gate.weight, up.weight, down.weight, gate.fp8_input_scale,
                                   down.fp8_input_scale, down.fp8_grad_scale, gate.fp8_grad_scale, up.fp8_grad_scale,
                                   down.fp8_grad_amax, gate.fp8_grad_amax, up.fp8_grad_amax, gate.linear_mm_config,
                                   gate.config)
    if training:
        down.fp8_input_amax.copy_(torch.maximum(down.fp8_input_amax, h_amax))
    return y


def use_fused_mlp(model: torch.nn.Module) -> int:
    """Every transformers ``LlamaMLP`` in ``model`` whose three projections are delayed fp8 linears (bias-free)
    runs :func:`fused_mlp_forward`; returns how many."""
    import types

    n = 0
    for m in model.modules():
        if type(m).__name__ == "LlamaMLP" and all(getattr(getattr(m, p), "fp8_ready", None) is not None
                                                 and getattr(m, p).bias is None
                                                 for p in ("gate_proj", "up_proj", "down_proj")):
            m.forward = types.MethodType(fused_mlp_forward, m)
            n += 1
    return n


def check(device: str = "cpu") -> None:
    """The kernels against their references (the fp8 bytes equal but for the SiLU's fp32 rounding: at most 1 in
    10^3 one step apart), raising on a mismatch."""
    torch.manual_seed(0)
    m, n = 192, 320  # neither a multiple of the 64 x 64 tile
    g, u, dh = (torch.randn(m, n, device=device, dtype=torch.bfloat16) * 3 for _ in range(3))
    s, sg, su = (torch.tensor(v, device=device) for v in (50.0, 1000.0, 2000.0))
    for name, got, want in (("forward", swiglu_fp8(g, u, s), swiglu_fp8_reference(g, u, s)),
                            ("backward", swiglu_fp8_backward(dh, g, u, sg, su),
                             swiglu_fp8_backward_reference(dh, g, u, sg, su))):
        for i, (a, b) in enumerate(zip(got, want)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise AssertionError(f"{name} output {i}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
            if a.dim() == 0:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=f"{name} amax {i}")
                continue
            a, b = a.float(), b.float()
            differ = a != b
            if device == "cpu":  # Triton's interpreter converts to fp8 with two faults of its own: a value that
                # rounds up to a power of two comes out as half of it, and subnormals round toward zero (one
                # subnormal step); every other byte must match
                fi = torch.finfo(want[i].dtype)
                step = fi.smallest_normal * fi.eps  # one subnormal step
                differ &= ~((b.abs() == 2.0 ** torch.log2(b.abs()).round()) & (a == b / 2))
                differ &= ~((b.abs() < fi.smallest_normal) & ((a - b).abs() <= step))
            off = differ.float().mean().item()
            close = torch.allclose(a[differ], b[differ], rtol=0.25, atol=0)  # one fp8 step at most
            if off > 1e-3 or not close:
                raise AssertionError(f"{name} output {i}: {off:.2%} of the bytes differ (close={close})")
    print(f"swiglu fp8 kernels match their references on {device}")


def check_mlp(device: str = "cpu", hidden: int = 64, ffn: int = 256, tokens: int = 256) -> None:
    """A transformers ``LlamaMLP`` under the delayed recipe, fused (:func:`use_fused_mlp`) against the same layers
    unfused, from the same state after a first step: outputs, gradients and the amaxes recorded for the next scales
    agree within what casting ``silu(g) * u`` and its gradients from fp32 instead of from their bf16 roundings
    changes (5% of the norm: a bf16 rounding moves about one value in 64 across an e5m2 rounding boundary, by a
    quarter).  On the CPU the fused MLP runs references with eager's bf16 roundings, and must then give the unfused
    layers' numbers (the wiring; ``check`` tests the kernels)."""
    import torchao.float8 as float8
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from mptrain.precision.fp8_linear import use_single_casts

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=ffn)).to(device, torch.bfloat16)
    float8.convert_to_float8_training(mlp, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    use_single_casts(mlp)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    kernels = dict(_KERNELS)
    if device == "cpu":
        _KERNELS.update(forward=_swiglu_fp8_eager_rounding, backward=_swiglu_fp8_backward_eager_rounding)
    try:
        results = _run_mlps(mlp, x, device)
    finally:
        _KERNELS.update(kernels)
    (y0, gx0, gw0, a0), (y1, gx1, gw1, a1) = results

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    errors = {"output": rel(y1, y0), "input gradient": rel(gx1, gx0),
              **{f"weight gradient {i}": rel(a, b) for i, (a, b) in enumerate(zip(gw1, gw0))},
              "amaxes": rel(a1, a0)}
    bad = {k: v for k, v in errors.items() if not v < (1e-6 if device == "cpu" else 0.05)}
    if bad:
        raise AssertionError(f"fused MLP differs from the unfused delayed layers: {bad}")
    print("fused MLP matches the delayed layers on " + device + ": "
          + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))


def _run_mlps(mlp, x, device):
    """Two steps of ``mlp`` unfused, then fused: per case the second step's output, input and weight gradients
    and recorded amaxes."""
    import copy

    from mptrain.precision.fp8_delayed import use_delayed_scaling

    results = []
    for fused in (False, True):
        m = copy.deepcopy(mlp)
        scaling = use_delayed_scaling(m, torch.device(device))
        for step in range(2):  # the first step finds the history; the second runs at delayed scales
            if fused and step == 1:
                assert use_fused_mlp(m) == 1
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.backward(torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape).to(y.dtype))
            if step == 0:
                scaling.update()
                for p in m.parameters():
                    p.grad = None
        scaling.fold_grad_amaxes()
        amaxes = torch.stack([l.fp8_input_amax for l in scaling.layers] + scaling._grad_amax)
        results.append((y.float(), xi.grad.float(), [p.grad.float() for p in m.parameters()], amaxes))
    return results


if __name__ == "__main__":
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    check(dev)
    check_mlp(dev)
