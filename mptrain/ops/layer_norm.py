"""LayerNorm / RMSNorm ops: autograd functions over csrc/layer_norm.cu and the dispatch
between them and the pure-PyTorch references in :mod:`mptrain.ops.reference`.

The kernel takes fp32/fp16/bf16 input with weight/bias in the input's dtype or fp32
(the ``*-master`` precisions keep normalization weights in fp32 under half activations),
saves fp32 mean/rstd, and returns dx, dweight, dbias in the dtypes of x and the params.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.autograd.function import once_differentiable

from . import reference

FUSED_CHOICES = ("auto", True, False)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _extension(required: bool = False):
    """The built extension, or None (not buildable here, or the loader is missing)."""
    try:
        from .build import get_extension
    except ImportError:
        if required:
            raise RuntimeError("fused=True but mptrain.ops.build is not available to build the extension") from None
        return None
    return get_extension(required=required)


def kernel_extension(op: str, x: torch.Tensor, params, fused="auto"):
    """The extension when the CUDA kernel should run for these tensors, else None.

    ``fused``: "auto" uses the kernel for CUDA tensors when the extension loads; False
    always uses the reference; True requires the kernel and raises when it cannot run.
    """
    if fused not in FUSED_CHOICES:
        raise ValueError(f"{op}: fused={fused!r}; expected one of {FUSED_CHOICES}")
    if fused is False:
        return None
    ok = x.is_cuda and x.dtype in _KERNEL_DTYPES and all(p is None or p.device == x.device for p in params)
    if not ok:
        if fused is True:
            raise RuntimeError(
                f"{op}: fused=True needs CUDA tensors on one device in float32/float16/bfloat16, got input "
                f"{x.dtype} on {x.device}; use fused='auto' to fall back to the reference"
            )
        return None
    return _extension(required=fused is True)


def _param_dtypes(x, weight, bias):
    """Params as the kernel takes them: x's dtype or fp32, both the same dtype."""
    dts = {p.dtype for p in (weight, bias) if p is not None}
    if not dts or dts == {x.dtype} or dts == {torch.float32}:
        return weight, bias
    # Mixed or foreign dtypes (e.g. fp16 params under bf16 input): compute with fp32
    # copies; autograd casts the gradients back to each parameter's dtype.
    return (None if weight is None else weight.float()), (None if bias is None else bias.float())


def _check_param(name, p, shape):
    if p is not None and tuple(p.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(p.shape)}, expected normalized_shape {list(shape)}")
    if p is not None and not p.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {p.dtype}")


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, hidden, eps, rms, ext):
        x = x.contiguous()
        # work: the forward's zeroed counter word for the backward's dweight/dbias finish.
        y, mean, rstd, work = ext.layer_norm_forward(x, weight, bias, hidden, eps, rms)
        ctx.save_for_backward(x, weight, bias, mean, rstd, work)
        ctx.hidden, ctx.rms, ctx.ext = hidden, rms, ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd, work = ctx.saved_tensors
        dx, dw, db = ctx.ext.layer_norm_backward(dy.contiguous(), x, mean, rstd, weight, bias, ctx.hidden, ctx.rms,
                                                 work)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None, None, None)


@functools.lru_cache(maxsize=None)
def _autocast_fp32_op(op: str) -> bool:
    """Whether CUDA autocast runs ``op`` in fp32 (layer_norm always; rms_norm in recent torch)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA"))
    except (AttributeError, RuntimeError):
        return op == "aten::layer_norm"


def _cuda_autocast_upcast(op, x, weight, bias):
    """Under CUDA autocast torch runs layer_norm (and rms_norm) in fp32 and returns fp32:
    do the same so the fused op is a drop-in there too (at the cost of one cast pass)."""
    if x.is_cuda and torch.is_autocast_enabled("cuda") and _autocast_fp32_op(op):
        return x.float(), None if weight is None else weight.float(), None if bias is None else bias.float()
    return x, weight, bias


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, fused="auto"):
    """``F.layer_norm`` with fp32 statistics; fused CUDA kernel for CUDA tensors.

    ``weight``/``bias`` may be fp32 under fp16/bf16 ``x``; the output has ``x``'s dtype.
    """
    shape = reference.normalized_dims(x, normalized_shape)
    _check_param("weight", weight, shape)
    _check_param("bias", bias, shape)
    x, weight, bias = _cuda_autocast_upcast("aten::layer_norm", x, weight, bias)
    ext = kernel_extension("layer_norm", x, (weight, bias), fused)
    if ext is None:
        return reference.layer_norm(x, shape, weight, bias, eps)
    weight, bias = _param_dtypes(x, weight, bias)
    return _NormFunction.apply(x, weight, bias, math.prod(shape), float(eps), False, ext)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, fused="auto"):
    """``F.rms_norm`` with fp32 statistics; fused CUDA kernel for CUDA tensors.

    ``eps=None`` is torch's default (fp32 machine epsilon for fp32/fp16/bf16 input).
    """
    shape = reference.normalized_dims(x, normalized_shape)
    _check_param("weight", weight, shape)
    x, weight, _ = _cuda_autocast_upcast("aten::rms_norm", x, weight, None)
    ext = kernel_extension("rms_norm", x, (weight,), fused)
    if ext is None:
        return reference.rms_norm(x, shape, weight, eps)
    weight, _ = _param_dtypes(x, weight, None)
    return _NormFunction.apply(x, weight, None, math.prod(shape), float(reference.rms_norm_eps(x, eps)), True, ext)
