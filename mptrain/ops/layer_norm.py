"""LayerNorm / RMSNorm: ``torch.ops.mptrain.layer_norm`` (one op, ``rms`` flag) or the reference, as
:mod:`mptrain.ops.dispatch` decides. Weight/bias may be in the input's dtype or fp32 (the ``*-master``
precisions keep normalization weights in fp32 under half activations); statistics are fp32. The op
checks shapes, devices and dtypes, not this hot path of every normalization layer.

Eager CUDA calls first try the extension's lean entry point (``csrc/fast_call.cpp``: the same op
through its typed dispatcher handle, without the boxed ``torch.ops`` call's host time); it answers
``NotImplemented`` for what it does not take (subclasses, torch-function modes, CUDA autocast, other
dtypes), which then goes the way below.
"""
from __future__ import annotations

import torch

from mptrain.compat import torch as compat

from . import dispatch, reference
from .dispatch import use_op
from .library import OPS

_layer_norm = OPS["layer_norm"]


def _param_dtypes(x, weight, bias):
    """Params as the kernel takes them: x's dtype or fp32, both the same dtype."""
    # Attribute reads and tuple tests only: this runs for every norm call.
    w, b = None if weight is None else weight.dtype, None if bias is None else bias.dtype
    if w in (x.dtype, None) and b in (x.dtype, None) or w in (torch.float32, None) and b in (torch.float32, None):
        return weight, bias
    # Mixed or foreign dtypes (e.g. fp16 params under bf16 input): compute with fp32
    # copies; autograd casts the gradients back to each parameter's dtype.
    return (None if weight is None else weight.float()), (None if bias is None else bias.float())


# Whether CUDA autocast runs the op in fp32 (layer_norm always; rms_norm in recent torch), looked up once
# (a plain dict: torch.compile traces it without a graph break).
_AUTOCAST_FP32 = {op: compat.has_autocast_cuda_kernel(op)
                  for op in ("aten::layer_norm", "aten::rms_norm")}


def _cuda_autocast_upcast(op, x, weight, bias):
    """Under CUDA autocast torch runs layer_norm (and rms_norm) in fp32 and returns fp32:
    do the same so the fused op is a drop-in there too (at the cost of one cast pass)."""
    if x.is_cuda and torch.is_autocast_enabled("cuda") and _AUTOCAST_FP32[op]:
        return x.float(), None if weight is None else weight.float(), None if bias is None else bias.float()
    return x, weight, bias


# torch's default RMSNorm eps (the math dtype's machine epsilon) per input dtype, looked up once.
_RMS_EPS = {dt: reference.rms_norm_eps(torch.empty(0, dtype=dt), None)
            for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def _shape(normalized_shape):
    return (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, fused="auto"):
    """``F.layer_norm`` with fp32 statistics, the fused kernel for CUDA tensors; ``weight``/``bias`` may
    be fp32 under fp16/bf16 ``x``; the output has ``x``'s dtype."""
    y = dispatch.call_fast("fast_norm", x, fused, normalized_shape, weight, bias, eps, False)
    if y is not NotImplemented:
        return y
    x, weight, bias = _cuda_autocast_upcast("aten::layer_norm", x, weight, bias)
    if not use_op("layer_norm", x, fused):
        return reference.layer_norm(x, normalized_shape, weight, bias, eps)
    weight, bias = _param_dtypes(x, weight, bias)
    return _layer_norm(x, _shape(normalized_shape), weight, bias, eps, False)[0]


def rms_norm(x, normalized_shape, weight=None, eps=None, *, fused="auto"):
    """``F.rms_norm`` with fp32 statistics, the fused kernel for CUDA tensors; ``eps=None`` is torch's
    default (fp32 machine epsilon for fp32/fp16/bf16 input)."""
    y = dispatch.call_fast("fast_norm", x, fused, normalized_shape, weight, None, eps, True)
    if y is not NotImplemented:
        return y
    x, weight, _ = _cuda_autocast_upcast("aten::rms_norm", x, weight, None)
    if not use_op("rms_norm", x, fused):
        return reference.rms_norm(x, normalized_shape, weight, eps)
    weight, _ = _param_dtypes(x, weight, None)
    if eps is None:
        eps = _RMS_EPS.get(x.dtype) or reference.rms_norm_eps(x, None)
    return _layer_norm(x, _shape(normalized_shape), weight, None, eps, True)[0]
