"""mptrain.ops.multi_tensor's wrappers over the ops: every call form reaches the right op."""
import torch

from mptrain import ops


def test_in_place_unscale_with_and_without_found_inf():
    ts = [torch.full((5,), 4.0), torch.full((3,), 8.0)]
    ops.multi_tensor_unscale_(ts, 0.25, torch.zeros(1))
    assert all(torch.equal(t, torch.full_like(t, v)) for t, v in zip(ts, (1.0, 2.0)))
    ops.multi_tensor_scale_(ts, ts, 2.0, None)  # in place, no found_inf
    assert all(torch.equal(t, torch.full_like(t, v)) for t, v in zip(ts, (2.0, 4.0)))


def test_check_only_forms_find_infs_and_write_nothing():
    ts = [torch.ones(4), torch.tensor([1.0, float("inf")])]
    before = [t.clone() for t in ts]
    found = torch.zeros(1)
    ops.multi_tensor_check_finite_(ts, found)
    assert found.item() == 1.0
    found.zero_()
    ops.multi_tensor_scale_(ts, ts, None, found)  # in place without a scale: a check
    assert found.item() == 1.0
    ops.multi_tensor_scale_(ts, [], None, None)  # nothing to write, nothing to report
    assert all(torch.equal(a, b) for a, b in zip(ts, before))


def test_copy_across_dtypes_and_l2norm():
    src, dst = [torch.randn(6), torch.randn(2)], [torch.empty(6, dtype=torch.bfloat16), torch.empty(2)]
    ops.multi_tensor_copy_(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))
    total, per = ops.multi_tensor_l2norm(src, per_tensor=True)
    torch.testing.assert_close(per, torch.stack([s.norm() for s in src]))
    torch.testing.assert_close(total, torch.cat(src).norm())
