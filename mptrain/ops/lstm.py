"""LSTM ops: ``torch.ops.mptrain.lstm_cell`` / ``lstm_layer`` or the references, as
:mod:`mptrain.ops.dispatch` decides.

``lstm_cell`` is one time step (two cuBLAS GEMMs + one pointwise kernel forward; one
pointwise kernel + the dx/dh/dW GEMMs backward) with a C++ autograd node on CUDA
(csrc/lstm_autograd.cu), so a step costs no Python beyond one call. ``lstm_layer`` is a
whole layer over a time-major sequence: one GEMM for every step's input projection,
then the time loop in C++ (no Python and no autograd node per step), and the weight
gradients as a few GEMMs over all steps at once. The ops check every tensor's shape,
device and dtype and name the one that is wrong.
"""
from __future__ import annotations

import torch

from . import reference
from .dispatch import FUSED_CHOICES, KERNEL_DTYPES, use_op  # noqa: F401  (re-exported for mptrain.nn)
from .library import OPS

_cell = OPS["lstm_cell"]
_layer = OPS["lstm_layer"]


def _autocast_dtype(x):
    """The CUDA autocast dtype when autocast is on for ``x``, else None.

    torch puts lstm_cell on autocast's lower-precision list; the kernels take one dtype,
    so under autocast every floating input is cast to it and the op runs with autocast off."""
    return torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else None


def _cast(tensors, dtype):
    return [None if t is None else (t.to(dtype) if t.is_floating_point() else t) for t in tensors]


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One LSTM step, torch.nn.LSTMCell's math and gate order (i, f, g, o).

    x (B, I), h and c (B, H), w_ih (4H, I), w_hh (4H, H), b_ih / b_hh (4H) or None.
    Returns (h', c'). CUDA tensors use the fused kernel when the extension is loaded.
    """
    dtype = _autocast_dtype(x)
    if dtype is not None and fused is not False and use_op("lstm_cell", x, fused, dtype):
        with torch.autocast("cuda", enabled=False):
            h1, c1, _ = _cell(*_cast((x, h, c, w_ih, w_hh, b_ih, b_hh), dtype))
        return h1, c1
    if dtype is not None or not use_op("lstm_cell", x, fused):
        return reference.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
    h1, c1, _ = _cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
    return h1, c1


def lstm_layer(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One unidirectional LSTM layer over a time-major sequence x (T, B, I).

    Returns (out (T, B, H), h_n (B, H), c_n (B, H)), h_n being a view of out[-1].
    """
    if x.dim() != 3 or x.shape[0] == 0:
        raise ValueError(f"lstm_layer: x must be (T, batch, input_size) with T >= 1, got shape {tuple(x.shape)}")
    tensors = (x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    dtype = _autocast_dtype(x)
    if dtype is not None and fused is not False and use_op("lstm_layer", x, fused, dtype):
        with torch.autocast("cuda", enabled=False):
            out, c_n, _, _ = _layer(*_cast(tensors, dtype))
    elif dtype is not None or not use_op("lstm_layer", x, fused):
        out, c_n = reference.lstm_layer(*tensors)
    else:
        out, c_n, _, _ = _layer(*tensors)
    return out, out[-1], c_n
