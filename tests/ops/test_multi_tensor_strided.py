"""mptrain.ops.multi_tensor on gradients of any layout (a transposed view, a slice): what the precision engine
unscales, checks, copies and measures.  Each test runs twice: through the CPU dispatch as it is (the reference),
and through a stand-in for the CUDA kernels that enforces csrc's own checks (every tensor dense, a pair's strides
equal) and records what reached it, so the Python-side split between the kernel and the reference is what is
tested; tests/gpu/test_multi_tensor.py runs the real kernels."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import multi_tensor
from mptrain.ops.library import OPS


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's own predicate: empty_like(preserve_format) copies the strides exactly of a dense tensor."""
    return torch.empty_like(t, memory_format=torch.preserve_format).stride() == t.stride()


class StrictKernels:
    """The multi-tensor ops as csrc's for_each_launch checks them, then computed by the CPU op."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []  # every tensor a "kernel" received

    def _check(self, name, *lists):
        for d, lst in enumerate(lists):
            for i, t in enumerate(lst):
                if not is_non_overlapping_and_dense(t):
                    raise RuntimeError(f"{name}: list {d} tensor {i} is not dense (call .contiguous() on it)")
                if t.stride() != lists[0][i].stride():
                    raise RuntimeError(f"{name}: list {d} tensor {i} has strides {t.stride()} but list 0 has "
                                       f"{lists[0][i].stride()}")
                self.seen.append(t)

    def __getitem__(self, name):
        def kernel(*args):
            self._check(name, *[a for a in args if isinstance(a, list)])
            return OPS[name](*args)

        return kernel


@pytest.fixture(params=["reference", "kernel"])
def kernels(request, monkeypatch):
    """None (the CPU dispatch as it is) or the StrictKernels every multi-tensor call goes to."""
    if request.param == "reference":
        return None
    strict = StrictKernels()
    monkeypatch.setattr(multi_tensor, "OPS", strict)
    monkeypatch.setattr(multi_tensor, "_use_op", lambda op, tensors, fused: True)
    return strict


def _strided_grads(dtype=torch.float32, seed=0):
    """A contiguous grad, a transposed view (dense, other strides), a slice of columns and a step slice (gaps)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return [r(5, 7), r(9, 4).t(), r(6, 10)[:, 2:7], r(40)[::3]]


def _grad_scaler_unscale(grads, scale):
    """torch.amp.GradScaler's unscale_ on params holding ``grads`` (clones): (grads, found_inf)."""
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # sets the scale up, as the backward of a scaled loss would
    scaler.unscale_(opt)
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    return [p.grad for p in params], found


def _no_host_read(monkeypatch):
    """Fail on any host read of a tensor: the found_inf logic must stay on the device."""
    def boom(self, *args):
        raise AssertionError("a tensor was read on the host")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unscale_of_strided_grads_equals_grad_scaler(kernels, dtype, monkeypatch):
    grads = _strided_grads(dtype)
    expect, expect_found = _grad_scaler_unscale(grads, 1024.0)
    views = list(grads)  # unscaled in place: the same view objects, through to their storage
    found = torch.zeros(1)
    with monkeypatch.context() as m:
        _no_host_read(m)
        ops.multi_tensor_unscale_(grads, torch.tensor(1 / 1024), found)
    assert found.item() == 0 == expect_found
    for g, v, e in zip(grads, views, expect):
        assert g is v and g.stride() == v.stride()
        assert torch.equal(g, e)
    if kernels is not None:  # the dense ones (contiguous, transposed) keep the one launch
        assert [t.data_ptr() for t in kernels.seen] == [grads[0].data_ptr(), grads[1].data_ptr()]


def test_unscale_of_a_half_strided_grad_equals_torch_amp(kernels):
    grads = _strided_grads(torch.float16)
    expect = [g.clone() for g in grads]
    found_torch = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(expect, found_torch, torch.tensor(0.125))
    found = torch.zeros(1)
    ops.multi_tensor_unscale_(grads, 0.125, found)
    assert found.item() == found_torch.item() == 0
    assert all(torch.equal(g, e) for g, e in zip(grads, expect))


@pytest.mark.parametrize("where", [1, 2, 3])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_inf_in_a_strided_grad_sets_found_inf(kernels, where, bad, monkeypatch):
    grads = _strided_grads()
    grads[where][(1, 0) if grads[where].dim() == 2 else (1,)] = bad
    _, expect_found = _grad_scaler_unscale(grads, 8.0)
    found, checked = torch.zeros(1), torch.zeros(1)
    with monkeypatch.context() as m:
        _no_host_read(m)
        ops.multi_tensor_unscale_(grads, 0.125, found)
        ops.multi_tensor_check_finite_(grads, checked)
    assert found.item() == checked.item() == expect_found == 1.0


def test_clean_strided_grads_leave_found_inf_alone(kernels):
    grads = _strided_grads()
    found = torch.zeros(1)
    ops.multi_tensor_check_finite_(grads, found)
    ops.multi_tensor_scale_(grads, grads, None, found)  # in place without a scale: a check, nothing written
    assert found.item() == 0


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_copy_between_layouts(kernels, dst_dtype):
    """Half grads up into contiguous master grads (the master-weight path) and a contiguous grad down into a
    transposed view: every element lands at its index, whatever the strides."""
    src = _strided_grads(torch.float16)
    dst = [torch.full(s.shape, 777.0, dtype=dst_dtype) for s in src]
    ops.multi_tensor_copy_(dst, src)
    assert all(torch.equal(d, s.to(dst_dtype)) for d, s in zip(dst, src))
    down = [torch.full((4, 9), 777.0).t(), torch.full((6, 10), 777.0)[:, 2:7]]
    ups = [torch.randn(9, 4), torch.randn(6, 5)]
    ops.multi_tensor_copy_(down, ups)
    assert all(torch.equal(d, u) for d, u in zip(down, ups))
    if kernels is not None:  # only same-strides dense pairs reached the kernel
        assert [t.data_ptr() for t in kernels.seen] == [src[0].data_ptr(), dst[0].data_ptr()]


def test_l2norm_of_strided_grads(kernels):
    grads = _strided_grads()
    total, per = ops.multi_tensor_l2norm(grads, per_tensor=True)
    expect = torch.stack([g.double().norm() for g in grads])
    torch.testing.assert_close(per, expect.float())
    torch.testing.assert_close(total, expect.norm().float())
    assert torch.equal(ops.multi_tensor_l2norm(grads), total)


def test_unscale_of_a_strided_grad_under_torch_compile():
    """The split runs while tracing: one graph, and the slice is unscaled through to its storage."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base = torch.ones(4, 6)
    grads = [torch.full((3, 5), 2.0).t(), base[:, 1:4]]
    found = torch.zeros(1)

    @torch.compile(backend="eager", fullgraph=True)
    def unscale(gs, f):
        ops.multi_tensor_unscale_(gs, 0.5, f)

    unscale(grads, found)
    assert not counters["graph_break"]
    assert torch.equal(grads[0], torch.ones(5, 3)) and found.item() == 0
    assert torch.equal(base[:, 1:4], torch.full((4, 3), 0.5)) and torch.equal(base[:, 0], torch.ones(4))
