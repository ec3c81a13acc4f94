"""LSTM ops: autograd functions over the fused kernels in csrc/lstm_cell.cu, and the
dispatch between them and the pure-PyTorch references.

``lstm_cell`` is one time step (two cuBLAS GEMMs + one pointwise kernel forward; one
pointwise kernel + the dx/dh/dW GEMMs backward), wired to autograd in C++
(csrc/lstm_autograd.cu) so a step costs no Python beyond one call. ``lstm_layer`` is a
whole layer over a time-major sequence: one GEMM for every step's input projection,
then the time loop in C++ (no Python and no autograd node per step), and the weight
gradients as a few GEMMs over all steps at once.
"""
from __future__ import annotations

import torch

from . import reference

FUSED_CHOICES = ("auto", True, False)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_loaded = None  # the extension once loaded: a step-by-step LSTM loop asks on every call


def _extension():
    """The built extension, or None (not buildable here, or the loader is missing)."""
    global _loaded
    if _loaded is None:
        try:
            from .build import get_extension
        except ImportError:
            return None
        _loaded = get_extension(required=False)
    return _loaded


def _kernel_extension(x, fused):
    """The extension when the kernel should run for input ``x``, else None.

    ``fused``: "auto" uses the kernel for CUDA tensors when the extension loads; False
    always uses the reference; True requires the kernel and raises when it cannot run.
    (Only ``x`` is inspected here, the kernel checks every other tensor's device and
    dtype with a message naming it: this runs once per LSTM step.)
    """
    if fused is False:
        return None
    if fused is not True and fused != "auto":
        raise ValueError(f"fused={fused!r}: expected one of {FUSED_CHOICES}")
    if not x.is_cuda:
        if fused is True:
            raise RuntimeError("fused=True: the fused LSTM kernels need CUDA tensors; use fused='auto' on the CPU")
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype not in KERNEL_DTYPES:
        if fused is True:
            raise TypeError(f"fused=True: the fused LSTM kernels take {KERNEL_DTYPES}, got {dtype}; use fused='auto'")
        return None  # e.g. float64: the reference
    ext = _extension()
    if ext is None and fused is True:
        try:
            from .build import get_extension
        except ImportError as e:
            raise RuntimeError("fused=True but mptrain.ops.build is not available to build the extension") from e
        ext = get_extension(required=True)
    return ext


def _apply(function, ext, tensors):
    """function.apply(ext, *tensors), in the autocast dtype when autocast is on.

    torch puts lstm_cell on autocast's lower-precision list; the kernel takes one dtype,
    so under autocast every floating input is cast to it and the kernel runs with
    autocast off."""
    if not torch.is_autocast_enabled("cuda"):
        return function.apply(ext, *tensors)
    dtype = torch.get_autocast_dtype("cuda")
    cast = [None if t is None else (t.to(dtype) if t.is_floating_point() else t) for t in tensors]
    with torch.autocast("cuda", enabled=False):
        return function.apply(ext, *cast)


class LSTMCellFunction(torch.autograd.Function):
    """(h', c') = LSTM step; saves the activated gates (storage dtype) and c'.

    Used under autocast only (inputs cast first); otherwise the step goes to the C++
    autograd Function ``ext.lstm_cell_autograd`` (csrc/lstm_autograd.cu), same wiring
    without Python per call."""

    @staticmethod
    def forward(ctx, ext, x, h, c, w_ih, w_hh, b_ih, b_hh):
        c = c.contiguous()
        h1, c1, ws = ext.lstm_cell_forward(x, h, c, w_ih, w_hh, b_ih, b_hh)
        ctx.ext = ext
        ctx.set_materialize_grads(False)  # an unused h' or c' costs no zero tensor
        ctx.save_for_backward(x, h, c, w_ih, w_hh, ws, c1)
        return h1, c1

    @staticmethod
    def backward(ctx, dh, dc):
        x, h, c, w_ih, w_hh, ws, c1 = ctx.saved_tensors
        n = ctx.needs_input_grad
        need = [n[1], n[2], n[3], n[4], n[5], n[6] or n[7]]
        dh = None if dh is None else dh.contiguous()
        dc = None if dc is None else dc.contiguous()
        dx, dh0, dc0, dw_ih, dw_hh, db = ctx.ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)
        return None, dx, dh0, dc0, dw_ih, dw_hh, db if n[6] else None, db if n[7] else None


class LSTMLayerFunction(torch.autograd.Function):
    """(out, c_n) of one layer over x (T, B, I); h_n is out[-1]."""

    @staticmethod
    def forward(ctx, ext, x, h0, c0, w_ih, w_hh, b_ih, b_hh):
        x, c0 = x.contiguous(), c0.contiguous()
        out, c_all, ws = ext.lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
        ctx.ext = ext
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, h0, c0, w_ih, w_hh, out, c_all, ws)
        # A copy, so that the caller cannot modify the saved cell states through it.
        return out, c_all[-1].clone()

    @staticmethod
    def backward(ctx, d_out, dc_n):
        x, h0, c0, w_ih, w_hh, out, c_all, ws = ctx.saved_tensors
        n = ctx.needs_input_grad
        need = [n[1], n[2], n[3], n[4], n[5], n[6] or n[7]]
        d_out = None if d_out is None else d_out.contiguous()
        dc_n = None if dc_n is None else dc_n.contiguous()
        dx, dh0, dc0, dw_ih, dw_hh, db = ctx.ext.lstm_layer_backward(
            d_out, dc_n, x, h0, c0, out, c_all, ws, w_ih, w_hh, need
        )
        return None, dx, dh0, dc0, dw_ih, dw_hh, db if n[6] else None, db if n[7] else None


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One LSTM step, torch.nn.LSTMCell's math and gate order (i, f, g, o).

    x (B, I), h and c (B, H), w_ih (4H, I), w_hh (4H, H), b_ih / b_hh (4H) or None.
    Returns (h', c'). CUDA tensors use the fused kernel when the extension is loaded.
    """
    ext = _loaded
    # Hot path (a step loop calls this per step; host work is the cost of a cell step):
    # one call into the C++ autograd Function, which checks every tensor itself.
    if (
        ext is not None
        and x.is_cuda
        and (fused is True or fused == "auto")
        and x.dtype in KERNEL_DTYPES
        and not torch.is_autocast_enabled("cuda")
    ):
        return ext.lstm_cell_autograd(x, h, c, w_ih, w_hh, b_ih, b_hh)
    tensors = (x, h, c, w_ih, w_hh, b_ih, b_hh)
    ext = _kernel_extension(x, fused)
    if ext is None:
        return reference.lstm_cell(*tensors)
    if torch.is_autocast_enabled("cuda"):
        return _apply(LSTMCellFunction, ext, tensors)
    return ext.lstm_cell_autograd(*tensors)


def lstm_layer(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None, *, fused="auto"):
    """One unidirectional LSTM layer over a time-major sequence x (T, B, I).

    Returns (out (T, B, H), h_n (B, H), c_n (B, H)), h_n being a view of out[-1].
    """
    if x.dim() != 3 or x.shape[0] == 0:
        raise ValueError(f"lstm_layer: x must be (T, batch, input_size) with T >= 1, got shape {tuple(x.shape)}")
    tensors = (x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    ext = _kernel_extension(x, fused)
    if ext is None:
        out, c_n = reference.lstm_layer(*tensors)
    else:
        out, c_n = _apply(LSTMLayerFunction, ext, tensors)
    return out, out[-1], c_n
