"""``fp8-master``'s tensorwise linear: each operand cast to fp8 once, the fp8 input saved for backward.

torchao's float8 linear (``torchao.float8.Float8Linear``, tensorwise recipe) saves the bf16 input and weight for
backward and casts each operand once per GEMM that uses it: the input twice (forward; again for the weight
gradient), the weight twice (forward; again for the input gradient) and the output gradient twice.  With one
scale per tensor a second cast of the same tensor is the same bytes as the first, so this linear keeps the
first: it saves the fp8 input and weight (half the bytes of the bf16 input) and casts the output gradient once for
both backward GEMMs.  Every GEMM sees the very operands torchao's would (same scales, same fp8 values, same
layouts, the same ``torch._scaled_mm`` calls through torchao's fp8 tensor), so outputs and gradients are equal
to torchao's bit for bit (``tests/precision/test_fp8_linear.py``); the casts per step drop from six to three.

torchao stays the implementation of the casts (``hp_tensor_and_scale_to_float8`` at ``amax_to_scale`` of the
tensor's amax, as its ``hp_tensor_to_float8_dynamic``), the fp8 tensor layout and the scaled GEMMs; what changes is
which casts run, and that the amax is a reduction along rows first (:func:`tensor_amax`).  Only the tensorwise
recipe: row-wise scales differ between a tensor and its transpose, so there the second casts are not redundant and
torchao's linear is kept.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn


@functools.lru_cache(maxsize=None)
def _torchao():
    """torchao's float8 linear module (its names: the class, the cast, the roles), or None when this torchao
    spells them otherwise (then fp8-master keeps torchao's own linear).  Looked up once: every layer's forward
    and backward asks."""
    try:
        from torchao.float8 import float8_linear as T
    except ImportError:
        return None
    needed = ("Float8Linear", "hp_tensor_to_float8_dynamic", "GemmInputRole")
    return T if all(hasattr(T, n) for n in needed) else None


#: ``_torchao()``'s module once a layer class is made from it: the forwards and backwards read this global, which
#: dynamo traces as a constant (it warns on an lru_cache call inside a compiled region)
torchao_linear: Any = None


#: torchao's cast at a given scale and its amax -> scale, set when the layer class is made (read as globals in
#: compiled code); every torchao the fp8 extra admits has them under these names
cast_with_scale: Any = None
amax_to_scale: Any = None


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` in fp32, taken along the contiguous dimension first and then over those maxima: the same
    value (a max does not round).  Under ``torch.compile`` a reduction along rows has the loop shape of the kernel
    that produces ``x`` (an RMSNorm, the SwiGLU, a gradient), so inductor can compute it inside that kernel; a
    reduction over the whole tensor is a split reduction of its own, which reads ``x`` again or recomputes its
    producer (docs/fp8.md)."""
    a = x.detach().abs()
    if a.dim() >= 2:
        a = a.amax(dim=0 if a.dim() == 2 and a.stride(-1) != 1 and a.stride(0) == 1 else -1)
    return a.amax().float()


def _cast(T, x: torch.Tensor, dtype: torch.dtype, mm_config: Any, role: Any) -> torch.Tensor:
    """torchao's tensorwise current-scaling cast (``hp_tensor_to_float8_dynamic``: the scale from the tensor's amax,
    then the cast at that scale), the amax taken by :func:`tensor_amax`."""
    return cast_with_scale(x, amax_to_scale(tensor_amax(x), dtype), dtype, mm_config, role)


class _Fp8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` with fp8 operands, each cast once (module docstring)."""

    @staticmethod
    def forward(ctx, input_hp: torch.Tensor, weight_hp: torch.Tensor, mm_config: Any, config: Any):
        T = torchao_linear
        roles = T.GemmInputRole
        shape = input_hp.shape
        x = _cast(T, input_hp.reshape(-1, shape[-1]), config.cast_config_input.target_dtype, mm_config, roles.INPUT)
        w_t = _cast(T, weight_hp.t(), config.cast_config_weight.target_dtype, mm_config, roles.WEIGHT)
        ctx.save_for_backward(x, w_t)
        ctx.mm_config, ctx.config, ctx.input_shape = mm_config, config, shape
        out = torch.mm(x, w_t)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        T = torchao_linear
        x, w_t = ctx.saved_tensors
        shape = grad_output.shape
        g = _cast(T, grad_output.reshape(-1, shape[-1]), ctx.config.cast_config_grad_output.target_dtype,
                  ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.mm(g, w_t.t()).reshape(*ctx.input_shape[:-1], -1)
        if ctx.needs_input_grad[1]:  # a frozen weight: no GEMM for it
            grad_weight = torch.mm(g.t(), x)
        return grad_input, grad_weight, None, None


@functools.lru_cache(maxsize=None)
def fp8_linear_class() -> Optional[type]:
    """:class:`Fp8Linear`, made on first use: torchao is imported only by a run that converts layers (``import
    mptrain`` stays without it); None when this torchao does not have the parts it builds on."""
    global torchao_linear, cast_with_scale, amax_to_scale
    T = _torchao()
    if T is None:
        return None
    try:
        from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale as to_scale
    except ImportError:
        return None
    torchao_linear, cast_with_scale, amax_to_scale = T, hp_tensor_and_scale_to_float8, to_scale

    class Fp8Linear(T.Float8Linear):
        """torchao's ``Float8Linear`` (its config, mm config, Parameters and state-dict keys) with the forward of
        :class:`_Fp8Matmul`.  Made from a converted layer by :func:`use_single_casts` (a class change in place)."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as torchao's forward: the output in autocast's dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            out = _Fp8Matmul.apply(input, self.weight, self.linear_mm_config, self.config)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out

    Fp8Linear.__module__, Fp8Linear.__qualname__ = __name__, "Fp8Linear"  # pickled by name: __getattr__ below
    return Fp8Linear


def __getattr__(name: str) -> Any:
    if name == "Fp8Linear":
        cls = fp8_linear_class()
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def single_casts_apply(config: Any) -> Optional[str]:
    """None where :class:`Fp8Linear` computes what torchao's linear would with ``config``, else why not."""
    T = _torchao()
    if T is None:
        return "this torchao names its float8 linear's parts otherwise"
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    if any(c.scaling_granularity.name != "TENSORWISE" or c.scaling_type.name != "DYNAMIC" for c in casts):
        return "only tensorwise dynamic scaling casts each tensor once"
    pairs = ((config.cast_config_input, getattr(config, "cast_config_input_for_grad_weight", None)),
             (config.cast_config_weight, getattr(config, "cast_config_weight_for_grad_input", None)),
             (config.cast_config_grad_output, getattr(config, "cast_config_grad_output_for_grad_weight", None)))
    if any(b is not None and b != a for a, b in pairs):
        return "the config casts a tensor differently for its second GEMM"
    if getattr(config, "enable_fsdp_float8_all_gather", False):
        return "FSDP's float8 all-gather hands the weight over already cast"
    return None


def use_single_casts(module: nn.Module) -> list[str]:
    """Every torchao ``Float8Linear`` inside ``module`` whose config allows it becomes an :class:`Fp8Linear` in
    place (same Parameters); returns their qualified names."""
    T = _torchao()
    if T is None:
        return []
    names = []
    for name, m in module.named_modules():
        if type(m) is T.Float8Linear and single_casts_apply(m.config) is None:
            m.__class__ = fp8_linear_class()
            names.append(name)
    return names
