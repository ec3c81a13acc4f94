"""fuse_modules swaps torch modules for fused ones in place without changing outputs."""
import pytest
import torch
from torch import nn

from mptrain.nn import FusedLayerNorm, FusedLSTM, FusedLSTMCell, FusedRMSNorm, fuse_modules


class MyLayerNorm(nn.LayerNorm):
    """A user subclass: may override forward, so fuse_modules must leave it alone."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8, eps=1e-5)
        self.cell = nn.LSTMCell(8, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.bi = nn.LSTM(8, 4, bidirectional=True, batch_first=True)
        self.blocks = nn.Sequential(nn.LayerNorm(8, bias=False), MyLayerNorm(8))

    def forward(self, x):  # x: (B, T, 6)
        h = self.rms(self.ln(self.proj(x)))
        h, _ = self.lstm(h)
        h, _ = self.bi(h)
        hc, _ = self.cell(h[:, -1])
        return self.blocks(hc)


def test_fuse_modules_keeps_output_and_parameters():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(3, 5, 6)
    before = net(x)
    params = {n: p for n, p in net.named_parameters()}
    keys = list(net.state_dict())
    out = fuse_modules(net)
    assert out is net
    assert type(net.ln) is FusedLayerNorm and type(net.rms) is FusedRMSNorm
    assert type(net.cell) is FusedLSTMCell and type(net.lstm) is FusedLSTM
    assert type(net.bi) is nn.LSTM  # bidirectional: not supported, left alone
    assert type(net.blocks[0]) is FusedLayerNorm and type(net.blocks[1]) is MyLayerNorm
    assert list(net.state_dict()) == keys
    assert all(p is params[n] for n, p in net.named_parameters())
    torch.testing.assert_close(net(x), before, rtol=1e-6, atol=1e-6)


def test_optimizer_built_before_fusing_still_trains_the_model():
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    fuse_modules(net)
    w0 = net[1].weight.detach().clone()
    net(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(net[1].weight, w0)


def test_top_level_module_is_returned_fused():
    ln = nn.LayerNorm(5)
    f = fuse_modules(ln)
    assert type(f) is FusedLayerNorm and f.weight is ln.weight


def test_norms_pool_and_linear_change_class_in_place_keeping_hooks_and_sharing():
    from mptrain.nn import FusedMaxPool2d, PaddedLinear

    ln, head = nn.LayerNorm(8), nn.Linear(128, 8195)
    net = nn.Sequential(ln, ln, nn.MaxPool2d(2), nn.MaxPool2d(3, ceil_mode=True), head)  # ln shared by two slots
    seen = []
    ln.register_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    fuse_modules(net)
    assert net[0] is ln and net[1] is ln and type(ln) is FusedLayerNorm  # the same object, its class changed
    assert type(net[2]) is FusedMaxPool2d and net[2].fused == "auto"
    assert type(net[3]) is nn.MaxPool2d  # ceil_mode: the kernel does not take it
    assert net[4] is head and type(head) is PaddedLinear
    ln(torch.randn(2, 8))
    assert seen == ["FusedLayerNorm"]


def test_fuse_and_list_names_the_swaps_kinds_and_skip():
    from mptrain.nn.fuse import KINDS, MEASURED_FASTER, describe_swaps, fuse_and_list

    assert set(MEASURED_FASTER["eager"]) <= set(KINDS) and set(MEASURED_FASTER["compiled"]) <= set(KINDS)
    net = Net()
    keep = net.blocks
    _, swaps = fuse_and_list(net, ["layer_norm", "lstm"], skip=[keep], prefix="model")
    assert [(s.name, s.old, s.new) for s in swaps] == [("model.ln", "LayerNorm", "FusedLayerNorm"),
                                                      ("model.lstm", "LSTM", "FusedLSTM")]
    assert type(net.rms) is nn.RMSNorm and type(net.cell) is nn.LSTMCell and type(keep[0]) is nn.LayerNorm
    assert describe_swaps(swaps) == "1 LayerNorm -> FusedLayerNorm (model.ln), 1 LSTM -> FusedLSTM (model.lstm)"
    _, swaps = fuse_and_list(net)
    assert describe_swaps(swaps) == ("1 RMSNorm -> FusedRMSNorm (rms), 1 LSTMCell -> FusedLSTMCell (cell), "
                                     "1 LayerNorm -> FusedLayerNorm (blocks.0)")
    assert fuse_and_list(net)[1] == []  # nothing left: idempotent
    with pytest.raises(ValueError, match=r"unknown kinds \['layernorm'\]; valid: layer_norm, rms_norm"):
        fuse_modules(Net(), kinds=["layernorm"])
