"""CPU: the autograd wiring of the LSTM ops (torch.ops.mptrain.lstm_cell / lstm_layer,
whose CPU kernels run the CUDA entry points' algorithm step for step in PyTorch --
mptrain.ops.reference's op forms) against the differentiable reference.

This checks what the GPU tests cannot show on a machine without a GPU: the wiring of
needs_input_grad, undefined gradients, the order of returned gradients and the
layer-backward algorithm (recurrent dh, dc, dW_hh split at h0). The CUDA autograd node
(csrc/lstm_autograd.cu) has the same wiring; tests/gpu/test_lstm_cuda.py checks it."""
import pytest
import torch

from mptrain.ops import lstm as lstm_ops
from mptrain.ops import reference as R


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
def test_cell_function_wiring(mask, bias, used):
    args = _inputs((5, 7), 5, 4, bias, mask)
    leaves = [t for t in args if t is not None and t.requires_grad]
    _check(torch.ops.mptrain.lstm_cell(*args)[:2], R.lstm_cell(*args), leaves, used)
    _check(lstm_ops.lstm_cell(*args), R.lstm_cell(*args), leaves, used)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("used", [(1, 1, 1), (0, 0, 1), (0, 1, 0), (1, 0, 0)])
def test_layer_function_wiring(mask, bias, T, used):
    args = _inputs((T, 3, 5), 3, 4, bias, mask, seed=T)
    leaves = [t for t in args if t is not None and t.requires_grad]
    out_k = lstm_ops.lstm_layer(*args)
    out_r, c_r = R.lstm_layer(*args)
    _check(out_k, (out_r, out_r[-1], c_r), leaves, used)
