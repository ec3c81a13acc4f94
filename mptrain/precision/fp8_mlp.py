"""``fp8-master``'s delayed recipe on a transformers Llama MLP: the three GEMMs, their casts and the SiLU x mul in one
autograd function, the SiLU x mul writing fp8 (:mod:`.fp8_swiglu`).

``down_proj(silu(gate_proj(x)) * up_proj(x))`` over three :class:`~.fp8_delayed.DelayedFp8Linear` layers casts
x once for gate and up (their shared input scale), lets the SwiGLU kernel write down's fp8 input and its amax,
casts down's output gradient once for its two GEMMs, and lets the SwiGLU's backward kernel write the fp8 output
gradients of gate and up, both layouts, with their amaxes: no bf16 ``silu(g) * u`` or bf16 gradient of g and u is
written, and no amax recomputes them.  Amaxes reach the layers' state as the unfused layers record them: the
forward's into the layers' running maxima, the backward's as the gradients of the layers' sinks.

:func:`use_fused_mlps` retypes every eligible ``LlamaMLP`` (exactly that class, SiLU, no biases, its three
projections delayed fp8 linears) in place: parameters, hooks and state-dict keys stay.  Its forward runs the
unfused layers whenever the fused path does not apply: the first step (no history yet), autocast, a projection
with hooks (the fused path never calls the projections), or once a projection has left fp8
(``auto_fp32_fallback``, the switch to fp32).  Numerics: the SiLU x mul and its gradients
are cast from fp32 (as inductor computes them) where eager's unfused layers round them to bf16 first.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from mptrain.compat import torch as compat
from mptrain.precision import fp8_linear
from mptrain.precision.fp8_linear import tensor_amax
from mptrain.precision.fp8_swiglu import fp8_swiglu, fp8_swiglu_backward

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _FusedFp8MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, x_scale, h_scale, gy_scale, gg_scale, gu_scale,
                sink_gy, sink_gg, sink_gu, mm_config, config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        T = fp8_linear.torchao_linear
        shape = x.shape
        x8 = fp8_linear.cast_with_scale(x.reshape(-1, shape[-1]), x_scale, config.cast_config_input.target_dtype,
                                        mm_config, T.GemmInputRole.INPUT)
        wdt = config.cast_config_weight.target_dtype
        wg_t, wu_t, wd_t = (fp8_linear._cast(T, w.t(), wdt, mm_config, T.GemmInputRole.WEIGHT)
                            for w in (w_gate, w_up, w_down))
        g, u = torch.mm(x8, wg_t), torch.mm(x8, wu_t)
        h_data, h_amax = fp8_swiglu(g, u, h_scale)
        h8 = Float8TrainingTensor(h_data, h_scale, x.dtype, mm_config, T.GemmInputRole.INPUT)
        y = torch.mm(h8, wd_t)
        ctx.save_for_backward(x8, wg_t, wu_t, wd_t, g, u, h8, gy_scale, gg_scale, gu_scale)
        ctx.mm_config, ctx.config, ctx.shape = mm_config, config, shape
        ctx.mark_non_differentiable(h_amax)
        return y.reshape(*shape[:-1], -1), h_amax

    @staticmethod
    def backward(ctx, grad_y, _):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        T = fp8_linear.torchao_linear
        x8, wg_t, wu_t, wd_t, g, u, h8, gy_scale, gg_scale, gu_scale = ctx.saved_tensors
        gy_hp = grad_y.reshape(-1, grad_y.shape[-1])
        gy = fp8_linear.cast_with_scale(gy_hp, gy_scale, ctx.config.cast_config_grad_output.target_dtype,
                                        ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)
        dh = torch.mm(gy, wd_t.t())
        grad_wd = torch.mm(gy.t(), h8)
        dg, du, dg_t, du_t, amax_g, amax_u = fp8_swiglu_backward(dh, g, u, gg_scale, gu_scale)

        def f8(data, scale):
            return Float8TrainingTensor(data, scale, grad_y.dtype, ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)

        grad_x = torch.mm(f8(dg, gg_scale), wg_t.t()) + torch.mm(f8(du, gu_scale), wu_t.t())
        grad_wg = torch.mm(f8(dg_t, gg_scale), x8)
        grad_wu = torch.mm(f8(du_t, gu_scale), x8)
        return (grad_x.reshape(ctx.shape), grad_wg, grad_wu, grad_wd, None, None, None, None, None,
                tensor_amax(gy_hp), amax_g, amax_u, None, None)


#: ``DelayedFp8Linear``, set by :func:`use_fused_mlps` (read as a global in compiled code)
_delayed_class: Optional[type] = None


def _hooked(m: nn.Module) -> bool:
    """Whether calling ``m`` would run hooks (its own or global ones) that the fused path, which never calls it,
    would skip: a user's activation logger, ``mptrain numerics``' recorders."""
    return any(compat.module_hooks(m).values()) or any(compat.module_hooks().values())


def _fused_ready(mlp: nn.Module) -> bool:
    """Whether the fused path applies now: three delayed layers past their first step, no autocast, no hooks on
    them."""
    return not torch.is_autocast_enabled() and all(
        type(m) is _delayed_class and m.fp8_ready and not _hooked(m) for m in (getattr(mlp, p) for p in _PROJECTIONS))


def fused_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``FusedFp8LlamaMLP.forward``: :class:`_FusedFp8MLP` over the MLP's projections, or the projections called
    as ``LlamaMLP`` calls them where the fused path does not apply (:func:`_fused_ready`)."""
    gate, up, down = (getattr(mlp, p) for p in _PROJECTIONS)
    if not _fused_ready(mlp):
        return down(mlp.act_fn(gate(x)) * up(x))
    training = torch.is_grad_enabled()
    if training:  # as the unfused layers record them: gate and up read x, down reads the SiLU x mul
        amax = tensor_amax(x)
        gate.fp8_input_amax.copy_(torch.maximum(gate.fp8_input_amax, amax))
        up.fp8_input_amax.copy_(torch.maximum(up.fp8_input_amax, amax))
    y, h_amax = _FusedFp8MLP.apply(x, gate.weight, up.weight, down.weight, gate.fp8_input_scale,
                                   down.fp8_input_scale, down.fp8_grad_scale, gate.fp8_grad_scale, up.fp8_grad_scale,
                                   down.fp8_grad_amax, gate.fp8_grad_amax, up.fp8_grad_amax, gate.linear_mm_config,
                                   gate.config)
    if training:
        down.fp8_input_amax.copy_(torch.maximum(down.fp8_input_amax, h_amax))
    return y


@functools.lru_cache(maxsize=None)
def fused_llama_mlp_class() -> Optional[type]:
    """:class:`FusedFp8LlamaMLP`, a subclass of transformers' ``LlamaMLP`` made on first use; None without
    transformers."""
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:
        return None

    class FusedFp8LlamaMLP(LlamaMLP):
        """A ``LlamaMLP`` whose forward is :func:`fused_forward` (module docstring)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fused_forward(self, x)

    FusedFp8LlamaMLP.__module__, FusedFp8LlamaMLP.__qualname__ = __name__, "FusedFp8LlamaMLP"
    return FusedFp8LlamaMLP


def __getattr__(name: str) -> Any:  # pickles of a fused model find the class by this name
    if name == "FusedFp8LlamaMLP":
        cls = fused_llama_mlp_class()
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _eligible(m: nn.Module, base: type) -> bool:
    from transformers.activations import SiLUActivation

    return (type(m) is base and isinstance(getattr(m, "act_fn", None), (SiLUActivation, nn.SiLU))
            and all(type(getattr(m, p, None)) is _delayed_class and getattr(m, p).bias is None
                    for p in _PROJECTIONS))


def use_fused_mlps(module: nn.Module) -> list[str]:
    """Every transformers ``LlamaMLP`` in ``module`` whose projections are delayed fp8 linears (bias-free, SiLU)
    becomes a ``FusedFp8LlamaMLP`` in place; returns their qualified names."""
    global _delayed_class
    from mptrain.precision.fp8_delayed import delayed_fp8_linear_class

    cls = fused_llama_mlp_class()
    if cls is None:
        return []
    _delayed_class = delayed_fp8_linear_class()
    base = cls.__mro__[1]
    names = [n for n, m in module.named_modules() if _eligible(m, base)]
    for n in names:
        module.get_submodule(n).__class__ = cls
    return names


def unfuse_mlps(module: nn.Module) -> list[str]:
    """The fused MLPs in ``module`` back to ``LlamaMLP``; returns their names."""
    cls = fused_llama_mlp_class()
    if cls is None:
        return []
    names = [n for n, m in module.named_modules() if type(m) is cls]
    for n in names:
        module.get_submodule(n).__class__ = cls.__mro__[1]
    return names
