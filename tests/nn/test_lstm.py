"""CPU: FusedLSTMCell / FusedLSTM are drop-ins for nn.LSTMCell / nn.LSTM (values, gradients,
parameter names, state_dict round trips), and the fused sequence path (impl="fused", which
runs the reference math on the CPU) equals nn.LSTM."""
import pytest
import torch
from torch import nn

from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell

F64 = torch.float64


def _grads(outputs, leaves, seed=5):
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, leaves, cot, allow_unused=True)


@pytest.mark.parametrize("bias", [True, False])
def test_cell_matches_nn_lstmcell(bias):
    torch.manual_seed(0)
    ref = nn.LSTMCell(7, 5, bias=bias, dtype=F64)
    ours = FusedLSTMCell(7, 5, bias=bias, dtype=F64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 7, dtype=F64, requires_grad=True)
    hx = (torch.randn(4, 5, dtype=F64, requires_grad=True), torch.randn(4, 5, dtype=F64, requires_grad=True))
    out_r, out_o = ref(x, hx), ours(x, hx)
    for a, b in zip(out_o, out_r):
        torch.testing.assert_close(a, b)
    leaves = [x, *hx]
    for a, b in zip(_grads(out_o, leaves + list(ours.parameters())), _grads(out_r, leaves + list(ref.parameters()))):
        torch.testing.assert_close(a, b)


def test_cell_unbatched_and_default_state():
    torch.manual_seed(1)
    ref = nn.LSTMCell(3, 2)
    ours = FusedLSTMCell(3, 2)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3)
    for a, b in zip(ours(x), ref(x)):
        assert a.shape == (2,)
        torch.testing.assert_close(a, b)
    xb = torch.randn(6, 3)
    for a, b in zip(ours(xb), ref(xb)):
        torch.testing.assert_close(a, b)
    hx = (torch.randn(2), torch.randn(2))
    for a, b in zip(ours(x, hx), ref(x, hx)):
        assert a.shape == (2,)
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        ours(torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match=r"hx\[1\] must be 1-D like the input, got 2-D"):
        ours(x, (hx[0], torch.randn(1, 2)))


def test_cell_state_dict_and_from_module():
    torch.manual_seed(2)
    ref = nn.LSTMCell(4, 3)
    ours = FusedLSTMCell(4, 3)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    ours.load_state_dict(ref.state_dict())
    back = nn.LSTMCell(4, 3)
    back.load_state_dict(ours.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
    shared = FusedLSTMCell.from_module(ref)
    assert all(a is b for a, b in zip(shared.parameters(), ref.parameters()))
    x = torch.randn(2, 4)
    for a, b in zip(shared(x), ref(x)):
        torch.testing.assert_close(a, b)


def _pair(num_layers=2, batch_first=False, bias=True, dropout=0.0, seed=3, impl="fused"):
    torch.manual_seed(seed)
    ref = nn.LSTM(6, 5, num_layers=num_layers, bias=bias, batch_first=batch_first, dropout=dropout, dtype=F64)
    ours = FusedLSTM(6, 5, num_layers=num_layers, bias=bias, batch_first=batch_first, dropout=dropout, dtype=F64, impl=impl)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("impl", ["fused", "auto", "cudnn"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_lstm_matches_nn_lstm(impl, batch_first, bias, with_state):
    ref, ours = _pair(batch_first=batch_first, bias=bias, impl=impl)
    T, B = 9, 3
    shape = (B, T, 6) if batch_first else (T, B, 6)
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    leaves = [x]
    hx = None
    if with_state:
        hx = (torch.randn(2, B, 5, dtype=F64, requires_grad=True), torch.randn(2, B, 5, dtype=F64, requires_grad=True))
        leaves += list(hx)
    out_r, (h_r, c_r) = ref(x, hx)
    out_o, (h_o, c_o) = ours(x, hx)
    assert out_o.shape == out_r.shape and h_o.shape == h_r.shape and c_o.shape == c_r.shape
    for a, b in zip((out_o, h_o, c_o), (out_r, h_r, c_r)):
        torch.testing.assert_close(a, b)
    g_o = _grads((out_o, h_o, c_o), leaves + list(ours.parameters()))
    g_r = _grads((out_r, h_r, c_r), leaves + list(ref.parameters()))
    for a, b in zip(g_o, g_r):
        torch.testing.assert_close(a, b)


def test_lstm_unbatched_and_single_layer():
    ref, ours = _pair(num_layers=1)
    x = torch.randn(4, 6, dtype=F64)
    out_r, (h_r, c_r) = ref(x)
    out_o, (h_o, c_o) = ours(x)
    assert out_o.shape == (4, 5) and h_o.shape == (1, 5)
    for a, b in zip((out_o, h_o, c_o), (out_r, h_r, c_r)):
        torch.testing.assert_close(a, b)
    hx = (torch.randn(1, 5, dtype=F64), torch.randn(1, 5, dtype=F64))
    for a, b in zip(ours(x, hx)[1], ref(x, hx)[1]):
        torch.testing.assert_close(a, b)


def test_lstm_dropout_between_layers():
    ref, ours = _pair(dropout=0.5)
    x = torch.randn(5, 2, 6, dtype=F64)
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x)[0], ref(x)[0])  # eval: no dropout, equal
    ours.train()
    torch.manual_seed(0)
    a = ours(x)[0]
    assert not torch.allclose(a, ref(x)[0])  # train: dropout between the layers is applied
    torch.manual_seed(0)
    torch.testing.assert_close(ours(x)[0], a)  # and drawn from torch's RNG


def test_lstm_state_dict_keys_and_round_trip():
    ref, ours = _pair()
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert "weight_ih_l1" in ours.state_dict() and "bias_hh_l0" in ours.state_dict()
    back = nn.LSTM(6, 5, num_layers=2, dtype=F64)
    back.load_state_dict(ours.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)


def test_lstm_from_module_shares_parameters():
    ref, _ = _pair()
    ours = FusedLSTM.from_module(ref, impl="fused")
    assert all(a is b for a, b in zip(ours.parameters(), ref.parameters()))
    x = torch.randn(3, 2, 6, dtype=F64)
    torch.testing.assert_close(ours(x)[0], ref(x)[0])


def test_lstm_policy_and_unsupported_configs():
    assert FusedLSTM(3, 4).resolved_impl(torch.randn(2, 1, 3)) == "cudnn"  # CPU: torch's own path
    assert FusedLSTM(3, 4, impl="fused").resolved_impl(torch.randn(2, 1, 3)) == "fused"
    with pytest.raises(ValueError, match="unidirectional"):
        FusedLSTM(3, 4, bidirectional=True)
    with pytest.raises(ValueError, match="proj_size"):
        FusedLSTM(3, 4, proj_size=2)
    with pytest.raises(ValueError, match="impl"):
        FusedLSTM(3, 4, impl="fast")
    with pytest.raises(ValueError, match="h_0"):
        FusedLSTM(3, 4, impl="fused")(torch.randn(2, 5, 3), (torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 3), [3, 2])
    with pytest.raises(TypeError, match="PackedSequence"):
        FusedLSTM(3, 4, impl="fused")(packed)
    FusedLSTM(3, 4)(packed)  # auto hands PackedSequence to torch
