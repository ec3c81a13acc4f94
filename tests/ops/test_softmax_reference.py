"""The scaled masked softmax reference (CPU fallback and test oracle) against the
masked-fill formula it replaces."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import reference


def _formula(x, mask, scale):
    return torch.softmax((x.double() * scale).masked_fill(mask, float("-inf")), dim=-1)


def test_no_mask_is_scaled_softmax():
    x = torch.randn(2, 3, 5, 7)
    torch.testing.assert_close(ops.scaled_masked_softmax(x, scale=0.3), torch.softmax(x * 0.3, -1))


@pytest.mark.parametrize("mshape", [(2, 1, 5, 7), (2, 1, 1, 7), (1, 1, 5, 7), (7,), (2, 3, 5, 1), (2, 3, 5, 7)])
def test_broadcast_mask_matches_masked_fill_formula(mshape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=g)
    mask = torch.rand(mshape, generator=g) < 0.3
    y = ops.scaled_masked_softmax(x, mask, scale=0.7)
    want = _formula(x, mask, 0.7)
    dead = mask.expand(x.shape).all(-1, keepdim=True).expand(x.shape)
    torch.testing.assert_close(y[~dead], want[~dead].float())
    assert (y[dead] == 0).all()


def test_fully_masked_row_gives_zeros_and_zero_grad():
    x = torch.randn(2, 4, 6, requires_grad=True)
    mask = torch.zeros(2, 4, 6, dtype=torch.bool)
    mask[0, 1] = True
    mask[1, :, 2:] = True
    y = ops.scaled_masked_softmax(x, mask)
    assert torch.isfinite(y).all() and (y[0, 1] == 0).all()
    torch.testing.assert_close(y[0, 0].sum(), torch.tensor(1.0))
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all() and (x.grad[0, 1] == 0).all() and (x.grad[1, :, 2:] == 0).all()


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 6), (6, 3)])
def test_causal_is_top_left_triangular_mask(sq, sk):
    x = torch.randn(2, sq, sk)
    tri = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    y = ops.scaled_masked_softmax(x, causal=True, scale=2.0)
    torch.testing.assert_close(y, _formula(x, tri, 2.0).float())
    pad = torch.zeros(2, 1, sk, dtype=torch.bool)
    pad[:, :, 0] = True
    both = ops.scaled_masked_softmax(x, pad, causal=True)
    assert (both[:, 0] == 0).all()  # query 0 sees only key 0, which the padding masks
    torch.testing.assert_close(both[:, 1:], _formula(x, pad | tri, 1.0)[:, 1:].float())


def test_gradcheck_float64_with_mask():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, True, False, False]])
    assert torch.autograd.gradcheck(lambda t: reference.scaled_masked_softmax(t, mask, 0.5, True), (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_fp32_math(dtype):
    x = (torch.randn(3, 50) * 4).to(dtype)
    mask = torch.rand(3, 50) < 0.2
    y = ops.scaled_masked_softmax(x, mask, 0.125)
    assert y.dtype == dtype
    torch.testing.assert_close(y, _formula(x, mask, 0.125).to(dtype))


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(2, 3, 4)
    with pytest.raises(TypeError, match="bool"):
        ops.scaled_masked_softmax(x, torch.zeros(3, 4))
    with pytest.raises(RuntimeError):
        ops.scaled_masked_softmax(x, torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        ops.scaled_masked_softmax(torch.randn(4), causal=True)
