"""FusedScaleMaskSoftmax: the module around mptrain.ops.scaled_masked_softmax."""
import torch

from mptrain.nn import FusedScaleMaskSoftmax


def test_module_matches_masked_fill_formula():
    m = FusedScaleMaskSoftmax(scale=0.25)
    x = torch.randn(2, 4, 5, 5)
    mask = torch.rand(2, 1, 5, 5) < 0.3
    mask[..., 0] = False  # no fully masked rows here
    want = torch.softmax((x * 0.25).masked_fill(mask, float("-inf")), -1)
    torch.testing.assert_close(m(x, mask), want)


def test_causal_module_and_no_state():
    m = FusedScaleMaskSoftmax(causal=True)
    x = torch.randn(3, 4, 4)
    y = m(x)
    assert (y.triu(1) == 0).all()
    torch.testing.assert_close(y.sum(-1), torch.ones(3, 4))
    assert m.state_dict() == {} and "causal=True" in repr(m)
