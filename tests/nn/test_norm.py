"""FusedLayerNorm / FusedRMSNorm are drop-ins for torch.nn.LayerNorm / RMSNorm."""
import pytest
import torch
from torch import nn

from mptrain.nn import FusedLayerNorm, FusedRMSNorm

LN_ARGS = [dict(normalized_shape=8), dict(normalized_shape=(3, 4), eps=1e-3),
           dict(normalized_shape=8, bias=False), dict(normalized_shape=8, elementwise_affine=False)]
RMS_ARGS = [dict(normalized_shape=8), dict(normalized_shape=(3, 4), eps=1e-3), dict(normalized_shape=8, elementwise_affine=False)]


def _randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()


@pytest.mark.parametrize("kwargs", LN_ARGS)
def test_layer_norm_drop_in(kwargs):
    torch.manual_seed(0)
    ref, ours = nn.LayerNorm(**kwargs), FusedLayerNorm(**kwargs)
    assert list(ref.state_dict()) == list(ours.state_dict())
    _randomize(ref)
    ours.load_state_dict(ref.state_dict())
    shape = (2, 5) + tuple(ref.normalized_shape)
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), ref(x2))
    ours(x).square().sum().backward()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    # and back: a FusedLayerNorm checkpoint loads into nn.LayerNorm
    back = nn.LayerNorm(**kwargs)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), ours(x))


@pytest.mark.parametrize("kwargs", RMS_ARGS)
def test_rms_norm_drop_in(kwargs):
    torch.manual_seed(1)
    ref, ours = nn.RMSNorm(**kwargs), FusedRMSNorm(**kwargs)
    assert list(ref.state_dict()) == list(ours.state_dict())
    _randomize(ref)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn((4,) + tuple(ref.normalized_shape), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), ref(x2))
    ours(x).sum().backward()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    back = nn.RMSNorm(**kwargs)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), ours(x))


def test_from_module_shares_parameters():
    ln = nn.LayerNorm(6)
    f = FusedLayerNorm.from_module(ln)
    assert f.weight is ln.weight and f.bias is ln.bias and f.eps == ln.eps
    r = nn.RMSNorm(6, eps=1e-4)
    fr = FusedRMSNorm.from_module(r.eval())
    assert fr.weight is r.weight and fr.eps == 1e-4 and not fr.training


def test_master_style_fp32_weight_half_input():
    m = FusedLayerNorm(16)
    x = torch.randn(3, 16).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16 and m.weight.dtype == torch.float32


def test_bad_fused_value():
    with pytest.raises(ValueError, match="fused"):
        FusedLayerNorm(4, fused="always")
