"""The multi-tensor references (CPU): unscale / copy / l2norm against plain torch."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tensors(dtype, sizes=(1, 7, 2049, 300), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_multiplies_and_leaves_found_inf_clear(dtype):
    grads = _tensors(dtype)
    expect = [(g.float() * 0.25).to(dtype) for g in grads]
    found = torch.zeros(1)
    ops.multi_tensor_unscale_(grads, torch.tensor(0.25), found)
    assert found.item() == 0
    for g, e in zip(grads, expect):
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_non_finite(dtype, bad):
    grads = _tensors(dtype)
    grads[2][2048] = bad
    found = torch.zeros(1)
    ops.multi_tensor_unscale_(grads, 0.5, found)
    assert found.item() == 1.0


def test_unscale_matches_torch_amp_kernel():
    grads = _tensors(torch.float32) + _tensors(torch.float16, seed=1)
    grads[1][3] = float("nan")
    ours = [g.clone() for g in grads]
    found_ours, found_torch = torch.zeros(1), torch.zeros(1)
    ops.multi_tensor_unscale_(ours, torch.tensor(1 / 1024), found_ours)
    inv = torch.tensor(1 / 1024)
    for dt in (torch.float32, torch.float16):
        group = [g for g in grads if g.dtype == dt]
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_torch, inv)
        except (RuntimeError, NotImplementedError):
            pytest.skip("torch has no CPU _amp_foreach_non_finite_check_and_unscale_")
    assert found_ours.item() == found_torch.item() == 1.0
    for a, b in zip(ours, grads):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_check_only_does_not_write():
    grads = _tensors(torch.bfloat16)
    before = [g.clone() for g in grads]
    found = torch.zeros(1)
    ops.multi_tensor.multi_tensor_check_finite_(grads, found)
    assert found.item() == 0 and all(torch.equal(a, b) for a, b in zip(grads, before))
    grads[0][0] = float("inf")
    ops.multi_tensor.multi_tensor_check_finite_(grads, found)
    assert found.item() == 1


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_converts_like_to(src_dtype, dst_dtype):
    src = _tensors(src_dtype)
    dst = [torch.full_like(s, 7.0, dtype=dst_dtype) for s in src]
    ops.multi_tensor_copy_(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(dst_dtype))


def test_scale_into_other_dtype_and_found_inf_untouched_when_finite():
    src = _tensors(torch.float16)
    dst = [torch.empty_like(s, dtype=torch.float32) for s in src]
    found = torch.zeros(1)
    ops.multi_tensor_scale_(src, dst, 2.0, found)
    assert found.item() == 0
    for d, s in zip(dst, src):
        assert torch.equal(d, s.float() * 2)


def test_l2norm_global_and_per_tensor_mixed_dtypes():
    ts = _tensors(torch.float32) + _tensors(torch.bfloat16, seed=3)
    total, per = ops.multi_tensor_l2norm(ts, per_tensor=True)
    expect_per = torch.stack([t.double().norm() for t in ts])
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(per.double(), expect_per, rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), expect_per.pow(2).sum().sqrt(), rtol=1e-6, atol=0)
    assert ops.multi_tensor_l2norm(ts).dim() == 0


def test_l2norm_of_non_finite_is_non_finite_and_empty_list_errors():
    ts = _tensors(torch.float32)
    ts[1][0] = float("inf")
    assert not torch.isfinite(ops.multi_tensor_l2norm(ts))
    with pytest.raises(ValueError, match="empty"):
        ops.multi_tensor_l2norm([])


def test_fused_argument_is_validated():
    with pytest.raises(ValueError, match="fused"):
        ops.multi_tensor_l2norm([torch.ones(2)], fused="yes")
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.multi_tensor_l2norm([torch.ones(2)], fused=True)


def test_found_inf_must_be_float32_scalar():
    with pytest.raises(TypeError, match="found_inf"):
        ops.multi_tensor_unscale_([torch.ones(2)], 1.0, torch.zeros(2))


def test_reference_adam_skip_is_bit_exact():
    p, g, m, v = torch.randn(10), torch.randn(10), torch.randn(10), torch.rand(10)
    step = torch.tensor(3.0)
    before = [t.clone() for t in (p, m, v, step)]
    reference.multi_tensor_adam([g], [p], [m], [v], [step], [], 1e-3, 0.9, 0.999, 1e-8, 0.1, True,
                                found_inf=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, step), before))
