"""Pure-PyTorch version of every kernel in csrc/: the test oracle and the CPU fallback.

Each function computes what its kernel computes (fp32 math, output in the storage
dtype) with plain torch ops, so tests can compare the two on any input.
"""
from __future__ import annotations

import torch

# [section: multi_tensor]
# [end section: multi_tensor]

# [section: layer_norm]
# [end section: layer_norm]

# [section: softmax]
# [end section: softmax]

# [section: lstm]
# Gate order is torch's (i, f, g, o) along the 4*hidden dimension.


def lstm_cell_pointwise_forward(igates, hgates, c, b_ih=None, b_hh=None):
    """The forward kernel: (h', c', workspace) from pre-activation gates.

    ``igates`` (B, 4H) [+ ``hgates``] [+ biases] in fp32; the workspace is the activated
    gates (i, f, g, o) rounded to the storage dtype, as the kernel saves them.
    """
    dtype = igates.dtype
    g = igates.float()
    for extra in (hgates, b_ih, b_hh):
        if extra is not None:
            g = g + extra.float()
    i, f, gg, o = g.chunk(4, dim=-1)
    i, f, gg, o = i.sigmoid(), f.sigmoid(), gg.tanh(), o.sigmoid()
    c_new = f * c.float() + i * gg
    h_new = o * c_new.tanh()
    return h_new.to(dtype), c_new.to(dtype), torch.cat([i, f, gg, o], dim=-1).to(dtype)


def lstm_cell_pointwise_backward(dh, dh2, dc, c_prev, c_new, ws):
    """The backward kernel: (d pre-activation gates, dc) from dh' (+ dh2), dc' and the
    saved workspace / c / c' (tanh(c') recomputed from the stored c', as the kernel does).
    Any of ``dh``, ``dh2``, ``dc`` may be None (zero)."""
    dtype = ws.dtype
    i, f, gg, o = ws.float().chunk(4, dim=-1)
    zero = torch.zeros_like(c_prev, dtype=torch.float32)
    dhv = sum((t.float() for t in (dh, dh2) if t is not None), zero)
    dcv = zero if dc is None else dc.float()
    tc = c_new.float().tanh()
    dct = dcv + dhv * o * (1 - tc * tc)
    dgates = torch.cat(
        [dct * gg * i * (1 - i), dct * c_prev.float() * f * (1 - f), dct * i * (1 - gg * gg), dhv * tc * o * (1 - o)],
        dim=-1,
    )
    return dgates.to(dtype), (dct * f).to(dtype)


def lstm_cell_gates(igates, hgates, c, b_ih=None, b_hh=None):
    """Differentiable pointwise part: (h', c') with fp32 math, outputs in the gates' dtype."""
    dtype = igates.dtype
    g = igates.float()
    for extra in (hgates, b_ih, b_hh):
        if extra is not None:
            g = g + extra.float()
    i, f, gg, o = g.chunk(4, dim=-1)
    c_new = f.sigmoid() * c.float() + i.sigmoid() * gg.tanh()
    h_new = o.sigmoid() * c_new.tanh()
    return h_new.to(dtype), c_new.to(dtype)


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """One LSTM step as torch.nn.LSTMCell computes it: GEMMs in the storage dtype,
    gate math in fp32. Differentiable; the CPU fallback and the test oracle."""
    linear = torch.nn.functional.linear
    return lstm_cell_gates(linear(x, w_ih), linear(h, w_hh), c, b_ih, b_hh)


def lstm_layer(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None):
    """One unidirectional LSTM layer over a time-major sequence x (T, B, I).

    Returns (out (T, B, H), c_n (B, H)); h_n is out[-1]. The input projections of all
    steps are one GEMM, as in the fused path."""
    xg = torch.nn.functional.linear(x, w_ih)
    h, c, outs = h0, c0, []
    for t in range(x.shape[0]):
        h, c = lstm_cell_gates(xg[t], torch.nn.functional.linear(h, w_hh), c, b_ih, b_hh)
        outs.append(h)
    return torch.stack(outs), c
# [end section: lstm]
