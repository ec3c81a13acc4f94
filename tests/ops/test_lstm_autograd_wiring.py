"""CPU: the autograd Functions of the kernel path (mptrain.ops.lstm) driven by a Python
emulation of the extension's LSTM API (same arguments, same algorithm as
csrc/lstm_cell.cu, built from the pointwise references), against reference autograd.

This checks what the GPU tests cannot show on a machine without a GPU: the wiring of
needs_input_grad, undefined gradients, the order of returned gradients and the
layer-backward algorithm (recurrent dh, in-place dc, dW_hh split at h0)."""
import pytest
import torch

from mptrain.ops import lstm as lstm_ops
from mptrain.ops import reference as R


class EmulatedExtension:
    """The C++ functions of csrc/lstm_cell.cu, step for step, in PyTorch."""

    def lstm_cell_autograd(self, *tensors):
        # csrc/lstm_autograd.cu's node has LSTMCellFunction's wiring (same needs-grad
        # flags, same returned gradients); its C++ wiring is tested on the GPU
        # (tests/gpu/test_lstm_cuda.py::test_cell_partial_gradients).
        return lstm_ops.LSTMCellFunction.apply(self, *tensors)

    @staticmethod
    def lstm_cell_forward(x, h, c, w_ih, w_hh, b_ih, b_hh):
        gates = x @ w_ih.t()
        gates.addmm_(h, w_hh.t())
        return list(R.lstm_cell_pointwise_forward(gates, None, c, b_ih, b_hh))

    @staticmethod
    def lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c_new, need):
        assert len(need) == 6
        dg, dc_prev = R.lstm_cell_pointwise_backward(dh, None, dc, c, c_new, ws)
        return [
            dg @ w_ih if need[0] else None,
            dg @ w_hh if need[1] else None,
            dc_prev if need[2] else None,
            dg.t() @ x if need[3] else None,
            dg.t() @ h if need[4] else None,
            dg.sum(0) if need[5] else None,
        ]

    @staticmethod
    def lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
        T, B, I = x.shape
        H = w_hh.shape[1]
        xg = (x.reshape(T * B, I) @ w_ih.t()).view(T, B, 4 * H)
        out, c_all, ws = (torch.empty(T, B, n, dtype=x.dtype) for n in (H, H, 4 * H))
        for t in range(T):
            xg[t].addmm_(h0 if t == 0 else out[t - 1], w_hh.t())
            out[t], c_all[t], ws[t] = R.lstm_cell_pointwise_forward(xg[t], None, c0 if t == 0 else c_all[t - 1], b_ih, b_hh)
        return [out, c_all, ws]

    @staticmethod
    def lstm_layer_backward(d_out, dc_n, x, h0, c0, out, c_all, ws, w_ih, w_hh, need):
        T, B, I = x.shape
        H = w_hh.shape[1]
        dg = torch.empty(T, B, 4 * H, dtype=x.dtype)
        dh_rec, dc_rec = None, (None if dc_n is None else dc_n.clone())
        for t in range(T - 1, -1, -1):
            dh_t = None if d_out is None else d_out[t]
            dg[t], dc_rec = R.lstm_cell_pointwise_backward(dh_t, dh_rec, dc_rec, c0 if t == 0 else c_all[t - 1], c_all[t], ws[t])
            if t > 0 or need[1]:
                dh_rec = dg[t] @ w_hh
        dg2 = dg.view(T * B, 4 * H)
        dw_hh = None
        if need[4]:
            dw_hh = dg[0].t() @ h0
            if T > 1:
                dw_hh.addmm_(dg[1:].reshape(-1, 4 * H).t(), out[:-1].reshape(-1, H))
        return [
            (dg2 @ w_ih).view(T, B, I) if need[0] else None,
            dh_rec if need[1] else None,
            dc_rec if need[2] else None,
            dg2.t() @ x.reshape(T * B, I) if need[3] else None,
            dw_hh,
            dg2.sum(0) if need[5] else None,
        ]


@pytest.fixture
def emulated(monkeypatch):
    ext = EmulatedExtension()
    monkeypatch.setattr(lstm_ops, "_kernel_extension", lambda x, fused: ext)
    return ext


def _inputs(shape_x, B, H, bias, grad_mask, seed=0):
    torch.manual_seed(seed)
    d = torch.float64
    I = shape_x[-1]
    ts = [torch.randn(*shape_x, dtype=d), torch.randn(B, H, dtype=d), torch.randn(B, H, dtype=d),
          torch.randn(4 * H, I, dtype=d) * 0.3, torch.randn(4 * H, H, dtype=d) * 0.3]
    ts += [torch.randn(4 * H, dtype=d), torch.randn(4 * H, dtype=d)] if bias else [None, None]
    return [None if t is None else t.requires_grad_(bool(m)) for t, m in zip(ts, grad_mask)]


MASKS = [(1, 1, 1, 1, 1, 1, 1), (1, 0, 0, 1, 0, 0, 1), (0, 0, 1, 0, 1, 1, 0), (0, 1, 0, 0, 0, 0, 0)]


def _check(out_k, out_r, leaves, used):
    for a, b in zip(out_k, out_r):
        torch.testing.assert_close(a, b)
    cot = [torch.randn_like(o) for o in out_r]
    pick = lambda outs: [o for o, u in zip(outs, used) if u]  # noqa: E731
    g_k = torch.autograd.grad(pick(out_k), leaves, pick(cot), allow_unused=True)
    g_r = torch.autograd.grad(pick(out_r), leaves, pick(cot), allow_unused=True)
    for a, b in zip(g_k, g_r):
        if b is None:
            assert a is None or (a == 0).all()
        else:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("used", [(1, 1), (1, 0), (0, 1)])
def test_cell_function_wiring(emulated, mask, bias, used):
    args = _inputs((5, 7), 5, 4, bias, mask)
    leaves = [t for t in args if t is not None and t.requires_grad]
    _check(lstm_ops.lstm_cell(*args), R.lstm_cell(*args), leaves, used)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("used", [(1, 1, 1), (0, 0, 1), (0, 1, 0), (1, 0, 0)])
def test_layer_function_wiring(emulated, mask, bias, T, used):
    args = _inputs((T, 3, 5), 3, 4, bias, mask, seed=T)
    leaves = [t for t in args if t is not None and t.requires_grad]
    out_k = lstm_ops.lstm_layer(*args)
    out_r, c_r = R.lstm_layer(*args)
    _check(out_k, (out_r, out_r[-1], c_r), leaves, used)
