"""The LayerNorm / RMSNorm references (CPU fallback and test oracle) against torch."""
import pytest
import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.ops import reference


def _params(shape, dtype, weight, bias, gen):
    w = torch.randn(shape, generator=gen).to(dtype) if weight else None
    b = torch.randn(shape, generator=gen).to(dtype) if bias else None
    return w, b


@pytest.mark.parametrize("shape,norm", [((5, 7), (7,)), ((2, 3, 16), (16,)), ((4, 3, 5), (3, 5)), ((1, 1), (1,))])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_equals_torch_fp32(shape, norm, weight, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 1
    w, b = _params(norm, torch.float32, weight, bias, g)
    torch.testing.assert_close(reference.layer_norm(x, norm, w, b, 1e-5), F.layer_norm(x, norm, w, b, 1e-5), rtol=0, atol=0)
    torch.testing.assert_close(ops.layer_norm(x, norm, w, b), F.layer_norm(x, norm, w, b))


@pytest.mark.parametrize("xdt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wdt", ["same", torch.float32])
def test_layer_norm_half_input_fp32_math(xdt, wdt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g).to(xdt)
    w, b = _params((40,), xdt if wdt == "same" else wdt, True, True, g)
    y = ops.layer_norm(x, (40,), w, b)
    assert y.dtype == xdt
    want = F.layer_norm(x.double(), (40,), w.double(), b.double()).to(xdt)
    torch.testing.assert_close(y, want)


def test_layer_norm_gradients_match_torch_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 9, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(4, 9, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad(ops.layer_norm(x, 9, w, b), (x, w, b), dy)
    theirs = torch.autograd.grad(F.layer_norm(x, (9,), w, b), (x, w, b), dy)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t)


def test_layer_norm_fp32_params_under_half_input_get_fp32_grads():
    x = torch.randn(3, 8).bfloat16().requires_grad_()
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    ops.layer_norm(x, 8, w, b).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("norm", [(16,), (3, 5)])
def test_rms_norm_equals_torch_fp32(eps, norm):
    g = torch.Generator().manual_seed(3)
    x = torch.randn((4,) + norm, generator=g)
    w = torch.randn(norm, generator=g)
    torch.testing.assert_close(reference.rms_norm(x, norm, w, eps), F.rms_norm(x, norm, w, eps))
    torch.testing.assert_close(ops.rms_norm(x, norm, None, eps), F.rms_norm(x, norm, None, eps))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_default_eps_is_torchs_for_half_input(dtype):
    # Small inputs make the eps choice visible: the installed torch's (fp32's epsilon for half input
    # from torch 2.7 on, the input dtype's on 2.6).
    x = (torch.randn(4, 32) * 1e-3).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, (32,)), F.rms_norm(x, (32,)))


def test_rms_norm_gradients_match_torch_float64():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 12, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(5, 12, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad(ops.rms_norm(x, 12, w, 1e-6), (x, w), dy)
    theirs = torch.autograd.grad(F.rms_norm(x, (12,), w, 1e-6), (x, w), dy)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t)


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="trailing dims"):
        ops.layer_norm(x, (4,))
    with pytest.raises((ValueError, RuntimeError), match="weight.*shape"):
        ops.layer_norm(x, (8,), torch.ones(4))
    with pytest.raises(ValueError, match="fused="):
        ops.layer_norm(x, (8,), fused="yes")
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.rms_norm(x, (8,), fused=True)
