"""LSTM ops: ``torch.ops.mptrain.lstm_cell`` / ``lstm_layer`` or the references, as :mod:`mptrain.ops.dispatch`
decides. ``lstm_cell`` is one time step (two cuBLAS GEMMs and one pointwise kernel) with a C++ autograd node on
CUDA (csrc/lstm_autograd.cu), so a step costs no Python beyond one call. ``lstm_layer`` is a whole layer
over a time-major sequence: one GEMM for every step's input projection, the time loop in C++, and the
weight gradients as a few GEMMs over all steps. The ops check every tensor and name the wrong one.
"""
from __future__ import annotations

import torch

from . import reference
from .dispatch import use_op
from .library import OPS


def _run(op, tensors, fused, reference_op):
    """The first two outputs of ``torch.ops.mptrain.<op>``, or ``reference_op``'s two, on ``tensors``. torch puts
    lstm_cell on CUDA autocast's lower-precision list; the kernels take one dtype, so under autocast every floating
    input is cast to the autocast dtype and the op runs with autocast off."""
    x = tensors[0]
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        if not use_op(op, x, fused, dtype):
            return reference_op(*tensors)
        with torch.autocast("cuda", enabled=False):
            return OPS[op](*[None if t is None else (t.to(dtype) if t.is_floating_point() else t)
                             for t in tensors])[:2]
    if not use_op(op, x, fused):
        return reference_op(*tensors)
    return OPS[op](*tensors)[:2]


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One LSTM step, torch.nn.LSTMCell's math and gate order (i, f, g, o): (h', c') from x (B, I),
    h and c (B, H), w_ih (4H, I), w_hh (4H, H), b_ih / b_hh (4H) or None."""
    return _run("lstm_cell", (x, h, c, w_ih, w_hh, b_ih, b_hh), fused, reference.lstm_cell)


def lstm_layer(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One unidirectional LSTM layer over a time-major sequence x (T, B, I): (out (T, B, H), h_n (B, H),
    c_n (B, H)), h_n being a view of out[-1]."""
    if x.dim() != 3 or x.shape[0] == 0:
        raise ValueError(f"lstm_layer: x must be (T, batch, input_size) with T >= 1, got shape {tuple(x.shape)}")
    out, c_n = _run("lstm_layer", (x, h0, c0, w_ih, w_hh, b_ih, b_hh), fused, reference.lstm_layer)
    return out, out[-1], c_n
