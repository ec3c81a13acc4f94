"""CUDA multi-tensor kernels (unscale / copy / l2norm) against the reference and float64:
awkward sizes, misaligned views, 1..500 tensors, every dtype, guard bands around every
output (no write outside a tensor), inf/NaN injection, CUDA-graph capture."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import reference
from mptrain.bench.graph_timing import capture_graph

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 3, 4, 5, 1023, 2048, 2049, 8191, 8192 + 7, 65537]
GUARD = 64  # a multiple of 4 elements: views at offset 0 stay 16-byte aligned


@pytest.fixture(scope="module")
def ext():
    return ops.get_extension(required=True)


class Guarded:
    """A tensor of n elements inside a buffer filled with a sentinel on both sides;
    ``offset`` elements of extra front padding make the view misaligned."""

    def __init__(self, n, dtype, offset=0, fill=None, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.buf = torch.full((n + 2 * GUARD + offset,), 777.0, device="cuda").to(dtype)
        self.lo, self.hi = GUARD + offset, GUARD + offset + n
        self.t = self.buf[self.lo:self.hi]
        if fill is None:
            self.t.copy_(torch.randn(n, device="cuda", generator=g))
        else:
            self.t.fill_(fill)
        self.sentinel = self.buf.clone()

    def guards_intact(self):
        return torch.equal(self.buf[: self.lo], self.sentinel[: self.lo]) and torch.equal(
            self.buf[self.hi:], self.sentinel[self.hi:])


def _lists(dtype, sizes=SIZES, misaligned_every=3, fill=None, seed=0):
    return [Guarded(n, dtype, offset=1 if i % misaligned_every == 1 else 0, fill=fill, seed=seed + i)
            for i, n in enumerate(sizes)]


def _assert_unscale_matches_reference(gs):
    """Our unscale by 1/3 equals the reference bit for bit, finds no inf, and writes inside the guards only."""
    ref = [g.t.clone() for g in gs]
    found, found_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    inv = torch.tensor([1 / 3], device="cuda")
    ops.multi_tensor_unscale_([g.t for g in gs], inv, found, fused=True)
    reference.multi_tensor_scale(ref, ref, inv, found_ref)
    assert found.item() == 0 == found_ref.item()
    for g, r in zip(gs, ref):
        assert torch.equal(g.t, r)
        assert g.guards_intact()


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_matches_reference_exactly(ext, dtype):
    gs = _lists(dtype)
    _assert_unscale_matches_reference(gs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unscale_matches_torch_amp(ext, dtype):
    gs = [torch.randn(n, device="cuda").to(dtype) for n in SIZES]
    theirs = [g.clone() for g in gs]
    found, found_t = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    inv = torch.tensor(2.0**-7, device="cuda")
    ops.multi_tensor_unscale_(gs, inv, found, fused=True)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_t, inv)
    assert all(torch.equal(a, b) for a, b in zip(gs, theirs)) and found.item() == found_t.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["first", "last", "misaligned", "tail"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_nan_anywhere_sets_found_inf(ext, dtype, where, bad):
    gs = _lists(dtype)
    idx = {"first": (0, 0), "last": (len(gs) - 1, -1), "misaligned": (1, 2), "tail": (7, -1)}[where]
    gs[idx[0]].t[idx[1]] = bad
    found = torch.zeros(1, device="cuda")
    ops.multi_tensor_unscale_([g.t for g in gs], 0.5, found, fused=True)
    assert found.item() == 1.0
    found = torch.zeros(1, device="cuda")
    ops.multi_tensor.multi_tensor_check_finite_([g.t for g in gs], found, fused=True)
    assert found.item() == 1.0


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_every_dtype_pair_overwrites_poisoned_outputs(ext, src_dtype, dst_dtype):
    src = _lists(src_dtype)
    dst = _lists(dst_dtype, fill=float("nan"), misaligned_every=4)
    ops.multi_tensor_copy_([d.t for d in dst], [s.t for s in src], fused=True)
    for s, d in zip(src, dst):
        assert torch.equal(d.t, s.t.to(dst_dtype))
        assert d.guards_intact()


@pytest.mark.parametrize("n_tensors", [1, 2, 37, 500])
def test_many_tensors_per_list(ext, n_tensors):
    sizes = [(7 * i + 1) % 3001 + 1 for i in range(n_tensors)]
    src = _lists(torch.bfloat16, sizes=sizes)
    dst = _lists(torch.float32, sizes=sizes, fill=float("nan"))
    found = torch.zeros(1, device="cuda")
    ops.multi_tensor_scale_([s.t for s in src], [d.t for d in dst], torch.tensor(4.0, device="cuda"), found,
                            fused=True)
    assert found.item() == 0
    assert all(torch.equal(d.t, s.t.float() * 4) and d.guards_intact() for s, d in zip(src, dst))


def test_empty_tensors_in_a_list(ext):
    ts = [torch.randn(5, device="cuda"), torch.empty(0, device="cuda"), torch.randn(3, device="cuda")]
    total, per = ops.multi_tensor_l2norm(ts, per_tensor=True, fused=True)
    assert per[1].item() == 0.0
    torch.testing.assert_close(total, torch.cat([ts[0], ts[2]]).norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_against_float64(ext, dtype):
    sizes = SIZES + [1 << 20, 3]
    ts = [g.t for g in _lists(dtype, sizes=sizes)]
    total, per = ops.multi_tensor_l2norm(ts, per_tensor=True, fused=True)
    exact = torch.stack([t.double().norm() for t in ts])
    torch.testing.assert_close(per.double(), exact, rtol=2e-6, atol=0)
    torch.testing.assert_close(total.double(), exact.pow(2).sum().sqrt(), rtol=2e-6, atol=0)
    again = ops.multi_tensor_l2norm(ts, fused=True)
    assert torch.equal(again, total)  # deterministic


def test_l2norm_non_finite(ext):
    ts = [torch.randn(10000, device="cuda") for _ in range(3)]
    ts[2][9999] = float("nan")
    assert torch.isnan(ops.multi_tensor_l2norm(ts, fused=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_long_tensors_match_reference_and_find_infs(ext, dtype):
    """Whole chunks and tails of long half tensors: exact results, guards intact, an inf
    in a full chunk or a tail is found by the unscale and by the read-only check."""
    sizes = SIZES + [16384, 16384 * 2 + 9]
    gs = _lists(dtype, sizes)
    _assert_unscale_matches_reference(gs)
    for i, j in ((len(sizes) - 1, 5000), (len(sizes) - 1, -1), (len(sizes) - 2, 16383)):
        gs = _lists(dtype, sizes)
        gs[i].t[j] = float("inf")
        found = torch.zeros(1, device="cuda")
        ops.multi_tensor_unscale_([g.t for g in gs], 0.5, found, fused=True)
        assert found.item() == 1.0, (i, j)
        found = torch.zeros(1, device="cuda")
        ops.multi_tensor.multi_tensor_check_finite_([g.t for g in gs], found, fused=True)
        assert found.item() == 1.0, (i, j)


def test_unscale_captured_in_a_cuda_graph(ext):
    grads = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in SIZES]
    inv = torch.ones((), device="cuda")
    found = torch.zeros((), device="cuda")
    graph, _ = capture_graph(lambda: ops.multi_tensor_unscale_(grads, inv, found, fused=True))
    fresh = [torch.randn_like(g) for g in grads]
    for g, f in zip(grads, fresh):
        g.copy_(f)
    inv.fill_(0.5)
    graph.replay()
    assert all(torch.equal(g, (f.float() * 0.5).to(g.dtype)) for g, f in zip(grads, fresh))
    assert found.item() == 0
    grads[3][0] = float("inf")
    graph.replay()
    assert found.item() == 1


def _strided(dtype, seed=0):
    """Grads of every layout: contiguous, a transposed view (dense), a column slice and a step slice (gaps); long
    enough for several chunks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)  # noqa: E731
    return [r(257, 129), r(300, 70).t(), r(96, 200)[:, 3:150], r(30001)[::3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unscale_of_strided_grads_matches_torch_amp(ext, dtype):
    """What torch.amp.GradScaler unscales, mptrain unscales too: the slices in place, through to their storage."""
    gs = _strided(dtype)
    theirs = [g.clone() for g in gs]
    found, found_t = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    inv = torch.tensor(2.0**-7, device="cuda")
    ops.multi_tensor_unscale_(gs, inv, found, fused=True)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_t, inv)
    assert all(torch.equal(a, b) for a, b in zip(gs, theirs)) and found.item() == found_t.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [1, 2, 3])
def test_inf_in_a_strided_grad_sets_found_inf(ext, dtype, where):
    gs = _strided(dtype)
    gs[where][(5, 7) if gs[where].dim() == 2 else (5,)] = float("inf")
    found, checked = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops.multi_tensor_unscale_(gs, 0.5, found, fused=True)
    ops.multi_tensor.multi_tensor_check_finite_(gs, checked, fused=True)
    assert found.item() == checked.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_copy_and_l2norm_of_strided_grads(ext, dtype):
    """The master-weight path: half grads of any layout copied up into contiguous fp32 grads, and their norm."""
    src = _strided(dtype)
    dst = [torch.full(s.shape, float("nan"), device="cuda") for s in src]
    ops.multi_tensor_copy_(dst, src, fused=True)
    assert all(torch.equal(d, s.float()) for d, s in zip(dst, src))
    total, per = ops.multi_tensor_l2norm(src, per_tensor=True, fused=True)
    exact = torch.stack([s.double().norm() for s in src])
    torch.testing.assert_close(per.double(), exact, rtol=2e-6, atol=0)
    torch.testing.assert_close(total.double(), exact.pow(2).sum().sqrt(), rtol=2e-6, atol=0)


def test_unscale_of_a_sliced_grad_captured_in_a_cuda_graph(ext):
    base = torch.zeros(64, 96, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(4096, device="cuda", dtype=torch.bfloat16), base[:, 8:40]]
    inv, found = torch.ones((), device="cuda"), torch.zeros((), device="cuda")
    graph, _ = capture_graph(lambda: ops.multi_tensor_unscale_(grads, inv, found, fused=True))
    fresh = [torch.randn_like(g) for g in grads]
    for g, f in zip(grads, fresh):
        g.copy_(f)
    inv.fill_(0.5)
    graph.replay()
    assert all(torch.equal(g, (f.float() * 0.5).to(g.dtype)) for g, f in zip(grads, fresh))
    assert not base[:, :8].any() and not base[:, 40:].any() and found.item() == 0
    grads[1][3, 3] = float("nan")
    graph.replay()
    assert found.item() == 1
