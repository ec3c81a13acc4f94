"""Max pooling: ``torch.ops.mptrain.max_pool2d`` for channels_last input, else torch's ``F.max_pool2d``,
as :mod:`mptrain.ops.dispatch` decides.  The op returns the window offset (int8) of every maximum beside
the output, and its backward gathers through them (csrc/max_pool.cu); dilation, ``ceil_mode`` and
returned indices are torch's alone (``mptrain.nn.FusedMaxPool2d`` routes those to torch).  Eager CUDA
calls first try the extension's lean entry point (``csrc/fast_call.cpp``), as the norms do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch
from .dispatch import use_op
from .library import OPS

_max_pool2d = OPS["max_pool2d"]
MAX_WINDOW = 127  # window elements an int8 offset can address


def as_pair(value) -> tuple:
    """``(v, v)`` for one number, the two values of a pair as a tuple (what torch's pooling arguments accept)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def max_pool2d(x, kernel_size, stride=None, padding=0, *, fused="auto"):
    """``F.max_pool2d(x, kernel_size, stride, padding)`` (dilation 1, floor mode): the fused kernel for
    4-d channels_last input (``fused=True``: any 4-d CUDA input, made channels_last), torch's otherwise.
    Ties and NaN as torch: the first maximum of a window wins, NaN wins over numbers.  The output is
    channels_last on the fused path."""
    # the lean entry point (csrc/fast_call.cpp): the op without torch.ops' boxed call, for the plain
    # channels_last case; NotImplemented sends everything else the way below
    y = dispatch.call_fast("fast_pool", x, fused, kernel_size, stride, padding)
    if y is not NotImplemented:
        return y
    k, p = as_pair(kernel_size), as_pair(padding)
    s = as_pair(stride) if stride is not None and stride != [] else k
    if x.dim() != 4 or k[0] * k[1] > MAX_WINDOW:
        if fused is True:
            raise ValueError(f"max_pool2d: fused=True needs 4-d input and a window of at most {MAX_WINDOW} elements, "
                             f"got input shape {tuple(x.shape)}, kernel_size={k}; use fused='auto'")
        return F.max_pool2d(x, k, s, p)
    if use_op("max_pool2d", x, fused) and (fused is True or x.is_contiguous(memory_format=torch.channels_last)):
        return _max_pool2d(x.contiguous(memory_format=torch.channels_last), k, s, p)[0]
    return F.max_pool2d(x, k, s, p)
