"""CPU: the LSTM references equal torch.nn.LSTMCell / nn.LSTM (values and gradients), and
the pointwise kernel references (what the CUDA kernels are tested against) equal autograd."""
import pytest
import torch
from torch import nn

from mptrain import ops
from mptrain.ops import reference


def _cell(input_size, hidden, bias=True, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.LSTMCell(input_size, hidden, bias=bias, dtype=dtype)


def _params(cell):
    return [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("batch,input_size,hidden", [(5, 7, 3), (1, 1, 1), (4, 16, 33)])
def test_reference_cell_matches_nn_lstmcell(batch, input_size, hidden, dtype, tol, bias):
    cell = _cell(input_size, hidden, bias, dtype)
    x = torch.randn(batch, input_size, dtype=dtype, requires_grad=True)
    h = torch.randn(batch, hidden, dtype=dtype, requires_grad=True)
    c = torch.randn(batch, hidden, dtype=dtype, requires_grad=True)
    h_t, c_t = cell(x, (h, c))
    h_r, c_r = reference.lstm_cell(x, h, c, *_params(cell))
    torch.testing.assert_close(h_r, h_t, rtol=tol, atol=tol)
    torch.testing.assert_close(c_r, c_t, rtol=tol, atol=tol)

    gh, gc = torch.randn_like(h_t), torch.randn_like(c_t)
    leaves = [x, h, c] + [p for p in _params(cell) if p is not None]
    g_t = torch.autograd.grad((h_t, c_t), leaves, (gh, gc))
    g_r = torch.autograd.grad((h_r, c_r), leaves, (gh, gc))
    for a, b in zip(g_r, g_t):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_ops_lstm_cell_on_cpu_is_the_reference():
    cell = _cell(6, 4, dtype=torch.float32)
    x, h, c = torch.randn(3, 6), torch.randn(3, 4), torch.randn(3, 4)
    got = ops.lstm_cell(x, h, c, *_params(cell))
    want = cell(x, (h, c))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.lstm_cell(x, h, c, *_params(cell), fused=True)
    with pytest.raises(ValueError, match="fused"):
        ops.lstm_cell(x, h, c, *_params(cell), fused="yes")


def test_reference_cell_bf16_rounds_only_at_the_end():
    """The storage dtype is bf16 but the gate math is fp32: the result equals the fp32
    computation (on bf16-rounded GEMM outputs) rounded once."""
    cell = _cell(8, 5, dtype=torch.bfloat16)
    x, h, c = (torch.randn(3, n).bfloat16() for n in (8, 5, 5))
    h_r, c_r = reference.lstm_cell(x, h, c, *_params(cell))
    assert h_r.dtype == c_r.dtype == torch.bfloat16
    ig = nn.functional.linear(x, cell.weight_ih).float()
    hg = nn.functional.linear(h, cell.weight_hh).float()
    g = ig + hg + cell.bias_ih.float() + cell.bias_hh.float()
    i, f, gg, o = g.chunk(4, 1)
    c32 = f.sigmoid() * c.float() + i.sigmoid() * gg.tanh()
    torch.testing.assert_close(c_r, c32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(h_r, (o.sigmoid() * c32.tanh()).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("with_hgates,with_bias", [(True, True), (False, True), (True, False)])
def test_pointwise_references_equal_autograd(with_hgates, with_bias):
    """The kernel-mirroring forward/backward references are the gate math and its exact
    gradient (float64, so the workspace rounding is a no-op)."""
    torch.manual_seed(1)
    B, H = 6, 5
    d = dict(dtype=torch.float64)
    ig = torch.randn(B, 4 * H, **d, requires_grad=True)
    hg = torch.randn(B, 4 * H, **d, requires_grad=True) if with_hgates else None
    b1 = torch.randn(4 * H, **d) if with_bias else None
    b2 = torch.randn(4 * H, **d) if with_bias else None
    c = torch.randn(B, H, **d, requires_grad=True)
    h1, c1, ws = reference.lstm_cell_pointwise_forward(ig, hg, c, b1, b2)
    h_a, c_a = reference.lstm_cell_gates(ig, hg, c, b1, b2)
    torch.testing.assert_close(h1, h_a)
    torch.testing.assert_close(c1, c_a)
    assert ws.shape == (B, 4 * H)

    dh, dh2, dc = torch.randn(B, H, **d), torch.randn(B, H, **d), torch.randn(B, H, **d)
    dg, dcp = reference.lstm_cell_pointwise_backward(dh, dh2, dc, c.detach(), c1.detach(), ws.detach())
    g_ig, g_c = torch.autograd.grad((h_a, c_a), (ig, c), (dh + dh2, dc), retain_graph=True)
    torch.testing.assert_close(dg, g_ig)
    torch.testing.assert_close(dcp, g_c)
    # Missing gradients count as zero.
    dg0, dcp0 = reference.lstm_cell_pointwise_backward(None, None, dc, c.detach(), c1.detach(), ws.detach())
    g_ig0, g_c0 = torch.autograd.grad((c_a,), (ig, c), (dc,))
    torch.testing.assert_close(dg0, g_ig0)
    torch.testing.assert_close(dcp0, g_c0)


@pytest.mark.parametrize("bias", [True, False])
def test_reference_layer_matches_nn_lstm(bias):
    torch.manual_seed(2)
    T, B, I, H = 7, 3, 5, 4
    lstm = nn.LSTM(I, H, bias=bias, dtype=torch.float64)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, B, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(1, B, H, dtype=torch.float64, requires_grad=True)
    out_t, (h_t, c_t) = lstm(x, (h0, c0))
    w = [lstm.weight_ih_l0, lstm.weight_hh_l0] + ([lstm.bias_ih_l0, lstm.bias_hh_l0] if bias else [None, None])
    out_r, h_r, c_r = ops.lstm_layer(x, h0[0], c0[0], *w)
    torch.testing.assert_close(out_r, out_t)
    torch.testing.assert_close(h_r, h_t[0])
    torch.testing.assert_close(c_r, c_t[0])
    g = torch.randn_like(out_t), torch.randn_like(c_t[0])
    leaves = [x, h0, c0] + [p for p in w if p is not None]
    for a, b in zip(
        torch.autograd.grad((out_r, c_r), leaves, g), torch.autograd.grad((out_t, c_t[0]), leaves, g)
    ):
        torch.testing.assert_close(a, b)


def test_lstm_layer_rejects_bad_shapes():
    with pytest.raises(ValueError, match="T >= 1"):
        ops.lstm_layer(torch.randn(0, 2, 3), torch.zeros(2, 4), torch.zeros(2, 4), torch.randn(16, 3), torch.randn(16, 4))
    with pytest.raises(ValueError, match="T, batch, input_size"):
        ops.lstm_layer(torch.randn(2, 3), torch.zeros(2, 4), torch.zeros(2, 4), torch.randn(16, 3), torch.randn(16, 4))
