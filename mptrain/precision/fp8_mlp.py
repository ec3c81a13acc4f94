"""``fp8-master``'s delayed recipe on a transformers gated MLP (Llama, Mistral, Qwen2, Qwen3): the three GEMMs, their
casts and the SiLU x mul in one autograd function, the SiLU x mul writing fp8 (:mod:`.fp8_swiglu`).

``down_proj(silu(gate_proj(x)) * up_proj(x))`` over three :class:`~.fp8_delayed.DelayedFp8Linear` layers casts
x once for gate and up (their shared input scale), lets the SwiGLU kernel write down's fp8 input and its amax,
casts down's output gradient once for its two GEMMs, and lets the SwiGLU's backward kernel write the fp8 output
gradients of gate and up, both layouts, with their amaxes: no bf16 ``silu(g) * u`` or bf16 gradient of g and u is
written, and no amax recomputes them.  Amaxes reach the layers' state as the unfused layers record them: the
forward's into the layers' running maxima, the backward's as the gradients of the layers' sinks.

:func:`use_fused_mlps` retypes every eligible MLP (exactly one of :data:`MLP_CLASSES`, SiLU, no biases, its three
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


def _fused_ready(mlp: nn.Module) -> bool:
    """Whether the fused path applies now: three delayed layers past their first step, no autocast, and no hooks
    (the projections' own or global ones) that the fused path, which never calls the projections, would skip: a
    user's activation logger, ``mptrain numerics``' recorders."""
    if torch.is_autocast_enabled() or any(compat.module_hooks().values()):
        return False
    return all(type(m) is _delayed_class and m.fp8_ready and not any(compat.module_hooks(m).values())
               for m in (getattr(mlp, p) for p in _PROJECTIONS))


def fused_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused MLPs' forward: :class:`_FusedFp8MLP` over the MLP's projections, or the projections called as
    transformers' MLP calls them where the fused path does not apply (:func:`_fused_ready`)."""
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


#: transformers' gated MLPs whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, by class name: the
#: module that defines each
MLP_CLASSES = {
    "LlamaMLP": "transformers.models.llama.modeling_llama",
    "MistralMLP": "transformers.models.mistral.modeling_mistral",
    "Qwen2MLP": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3MLP": "transformers.models.qwen3.modeling_qwen3",
}
_PREFIX = "FusedFp8"


@functools.lru_cache(maxsize=None)
def fused_mlp_class(name: str) -> Optional[type]:
    """``FusedFp8<name>``, a subclass of transformers' ``name`` (a key of :data:`MLP_CLASSES`) whose forward is
    :func:`fused_forward`, made on first use; None where this transformers lacks the class."""
    import importlib

    try:
        base = getattr(importlib.import_module(MLP_CLASSES[name]), name)
    except (ImportError, AttributeError):
        return None
    return type(_PREFIX + name, (base,), {
        "forward": fused_forward, "fp8_fused_mlp": True, "__module__": __name__,
        "__doc__": f"A ``{name}`` whose forward is ``mptrain.precision.fp8_mlp.fused_forward``."})


def __getattr__(name: str) -> Any:  # pickles of a fused model find the classes by these names
    if name.startswith(_PREFIX) and name[len(_PREFIX):] in MLP_CLASSES:
        cls = fused_mlp_class(name[len(_PREFIX):])
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fused_classes() -> dict[type, type]:
    """transformers' class -> its fused subclass, for the classes this transformers has."""
    made = (fused_mlp_class(n) for n in MLP_CLASSES)
    return {cls.__mro__[1]: cls for cls in made if cls is not None}


def _eligible(m: nn.Module, fused: dict[type, type], silu: tuple[type, ...]) -> bool:
    return (type(m) in fused and isinstance(getattr(m, "act_fn", None), silu)
            and all(type(getattr(m, p, None)) is _delayed_class and getattr(m, p).bias is None
                    for p in _PROJECTIONS))


def use_fused_mlps(module: nn.Module) -> list[str]:
    """Every transformers gated MLP in ``module`` (:data:`MLP_CLASSES`, exactly those classes) whose projections
    are delayed fp8 linears (bias-free, SiLU) becomes its fused subclass in place; returns their qualified names."""
    global _delayed_class
    from mptrain.precision.fp8_delayed import delayed_fp8_linear_class

    fused = _fused_classes()
    if not fused:
        return []
    from transformers.activations import SiLUActivation

    _delayed_class = delayed_fp8_linear_class()
    names = [n for n, m in module.named_modules() if _eligible(m, fused, (SiLUActivation, nn.SiLU))]
    for n in names:
        m = module.get_submodule(n)
        m.__class__ = fused[type(m)]
    return names


def is_fused_mlp(m: nn.Module) -> bool:
    """Whether ``m`` is one of the fused MLP classes (:func:`fused_mlp_class`)."""
    return getattr(type(m), "fp8_fused_mlp", False) is True


def unfuse_mlps(module: nn.Module) -> list[str]:
    """The fused MLPs in ``module`` back to transformers' classes; returns their names."""
    names = [n for n, m in module.named_modules() if is_fused_mlp(m)]
    for n in names:
        m = module.get_submodule(n)
        m.__class__ = type(m).__mro__[1]
    return names
