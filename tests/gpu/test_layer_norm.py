"""The fused LayerNorm / RMSNorm kernels against the reference and float64, on the GPU.

Fresh random inputs of awkward sizes: hidden 1, odd, not a multiple of the vector width,
up to 65536; one row and many; misaligned views; every dtype combination including
half input with fp32 weights; outputs allocated over NaN-poisoned memory.
"""
import pytest
import torch

from mptrain import ops
from mptrain.ops import reference
from mptrain.bench.graph_timing import capture_graph

COMBOS = [  # (input dtype, weight/bias dtype)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
]
HIDDEN = [1, 7, 64, 127, 256, 768, 1000, 1024, 1536, 2048, 4096, 5000, 8192, 12288, 16384, 20480, 32768, 65536]
# (rtol-like, atol-like) relative to the tensor's largest magnitude
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def extension():
    from mptrain.ops.build import get_extension

    return get_extension(required=True)


def poison(*specs):
    """Allocate and free NaN-filled blocks of these (numel, dtype) so the outputs the
    kernels allocate next land on NaN: anything left unwritten is caught."""
    blocks = [torch.full((n,), float("nan"), dtype=dt, device="cuda") for n, dt in specs]
    del blocks


def check(out, ref, truth, what):
    """``out`` close to the reference, and no further from float64 than it (2x + tol)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten or overflow)"
    tol = TOL[out.dtype] * max(1.0, truth.abs().max().item())
    diff = (out.double() - ref.double()).abs().max().item()
    assert diff <= tol, f"{what}: max |kernel - reference| = {diff:.3g} > {tol:.3g}"
    e_out = (out.double() - truth).abs().max().item()
    e_ref = (ref.double() - truth).abs().max().item()
    assert e_out <= 2 * e_ref + tol, f"{what}: error vs float64 {e_out:.3g}, reference's {e_ref:.3g}"


def run_norm(x, shape, w, b, rms, eps, fused):
    if rms:
        return ops.rms_norm(x, shape, w, eps, fused=fused)
    return ops.layer_norm(x, shape, w, b, eps, fused=fused)


def compare(x, shape, w, b, rms, eps=1e-5, what=""):
    """Forward and backward of the kernel vs the reference (same dtypes) and float64."""
    leaves = [t for t in (x, w, b) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    dy = torch.randn(x.shape, device="cuda").to(x.dtype)
    rows = x.numel() // max(1, torch.Size(shape).numel())
    poison((x.numel(), x.dtype), (rows, torch.float32), (rows, torch.float32))
    y = run_norm(x, shape, w, b, rms, eps, True)
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref = run_norm(x, shape, w, b, rms, eps, False)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    x64, w64, b64 = (None if t is None else t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = run_norm(x64, shape, w64, b64, rms, eps, False)
    grads64 = torch.autograd.grad(y64, [t for t in (x64, w64, b64) if t is not None], dy.double())
    check(y, y_ref, y64, f"{what} y")
    for name, g, gr, g64 in zip(("dx", "dweight", "dbias"), grads, grads_ref, grads64):
        check(g, gr, g64, f"{what} {name}")


def compare_one_and_many_rows(combo, hidden, seed, what):
    """LayerNorm (weight and bias) and RMSNorm (weight) on 1 row and on 3001 rows."""
    xdt, wdt = combo
    torch.manual_seed(seed)
    for rows in (1, 3001):
        x = torch.randn(rows, hidden, device="cuda").to(xdt)
        w = torch.randn(hidden, device="cuda").to(wdt)
        b = torch.randn(hidden, device="cuda").to(wdt)
        compare(x, (hidden,), w, b, False, what=f"{what} rows={rows} H={hidden}")
        compare(x.detach(), (hidden,), w.detach(), None, True, what=f"{what} rms rows={rows} H={hidden}")


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{str(c[0])[6:]}-{str(c[1])[6:]}")
def test_matches_reference_and_float64(combo, hidden, affine, rms):
    if rms and affine == "wb":
        pytest.skip("RMSNorm has no bias")
    xdt, wdt = combo
    torch.manual_seed(hidden * 7 + len(affine))
    for rows in (1, 203):
        x = (torch.randn(rows, hidden, device="cuda") * 2 + 0.5).to(xdt)
        w = (torch.randn(hidden, device="cuda") * 0.5 + 1).to(wdt) if affine != "none" else None
        b = torch.randn(hidden, device="cuda").to(wdt) if affine == "wb" else None
        compare(x, (hidden,), w, b, rms, what=f"rows={rows} H={hidden}")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{str(c[0])[6:]}-{str(c[1])[6:]}")
@pytest.mark.parametrize("rows,hidden", [(5000, 768), (3000, 1024), (517, 4096), (70, 16384)])
def test_many_rows_per_block(combo, rows, hidden):
    # More rows than one wave of the persistent backward grid: partial sums over many rows.
    xdt, wdt = combo
    x = torch.randn(rows, hidden, device="cuda").to(xdt)
    w = torch.randn(hidden, device="cuda").to(wdt)
    b = torch.randn(hidden, device="cuda").to(wdt)
    compare(x, (hidden,), w, b, False, what=f"rows={rows} H={hidden}")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{str(c[0])[6:]}-{str(c[1])[6:]}")
@pytest.mark.parametrize("hidden", [64, 256, 512, 768, 1000, 1024, 4096])
def test_one_and_many_rows(combo, hidden):
    # Every backward path at one row and at several rows per block: the split kernel with
    # its in-kernel finish (<= 128 vectors), the row-cached kernel and its finish kernel
    # (fp32 1024, 4096), the generic kernels (1000: not a whole number of vectors).
    compare_one_and_many_rows(combo, hidden, seed=hidden, what=f"H={hidden}")


@pytest.mark.parametrize("combo,hidden,rows", [(COMBOS[2], 1024, 70_000), (COMBOS[4], 768, 90_001),
                                               (COMBOS[0], 512, 50_000), (COMBOS[3], 256, 40_003),
                                               (COMBOS[1], 96, 20_000)],
                         ids=["bf16-1024", "bf16w32-768", "fp32-512", "fp16w32-256", "fp16-96"])
def test_split_many_rows_per_group(combo, hidden, rows):
    # Dozens of rows per row group: the DEPTH + 1 register slots rotate many times, rows
    # end at every slot position, and 1-4 warps per row (named barrier per group).
    xdt, wdt = combo
    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda").to(xdt)
    w = torch.randn(hidden, device="cuda").to(wdt)
    b = torch.randn(hidden, device="cuda").to(wdt)
    compare(x, (hidden,), w, b, False, what=f"rows={rows} H={hidden}")
    compare(x.detach(), (hidden,), None, None, True, what=f"rms no-weight rows={rows} H={hidden}")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 600, 1031])
def test_split_row_counts(rows):
    # Fewer rows than row groups, and counts that end mid-round of the slot rotation.
    torch.manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
    w = torch.randn(1024, device="cuda").to(torch.bfloat16)
    b = torch.randn(1024, device="cuda").to(torch.bfloat16)
    compare(x, (1024,), w, b, False, what=f"rows={rows}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [768, 1024, 1003])
def test_misaligned_and_strided_views(dtype, hidden):
    base = torch.randn(64 * hidden + 3, device="cuda").to(dtype)
    x = base[1 : 1 + 64 * hidden].view(64, hidden)  # storage offset: not 16-byte aligned
    wb = torch.randn(2 * hidden + 1, device="cuda").to(dtype)
    w, b = wb[1 : hidden + 1], wb[hidden + 1 :]
    compare(x.detach(), (hidden,), w.detach(), b.detach(), False, what="misaligned")
    xt = torch.randn(hidden, 40, device="cuda").to(dtype).t()  # non-contiguous input
    compare(xt, (hidden,), None, None, True, what="transposed")


def test_multi_dim_normalized_shape_and_eps():
    x = torch.randn(4, 6, 8, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 16, device="cuda")
    b = torch.randn(8, 16, device="cuda")
    compare(x, (8, 16), w, b, False, eps=1e-3, what="(8,16)")
    compare(x.detach(), (8, 16), w.detach(), None, True, eps=None, what="rms (8,16)")


def test_empty_input():
    x = torch.randn(0, 32, device="cuda", requires_grad=True)
    w = torch.randn(32, device="cuda", requires_grad=True)
    y = ops.layer_norm(x, 32, w, fused=True)
    (gw,) = torch.autograd.grad(y, (w,), torch.ones_like(y))
    assert y.shape == (0, 32) and (gw == 0).all()


# One shape per backward path: the split kernel with its in-kernel finish (bf16 768 / 1024),
# the row-cached kernel with the finish kernel (fp32 1024: 256 vectors; bf16 4096), the
# generic kernels (1000).
PATHS = [(torch.bfloat16, 768), (torch.bfloat16, 1024), (torch.float32, 1024), (torch.bfloat16, 4096),
         (torch.bfloat16, 1000)]


def _path_id(p):
    return f"{str(p[0])[6:]}-{p[1]}"


@pytest.mark.parametrize("path", PATHS, ids=_path_id)
def test_backward_is_deterministic(path):
    dtype, hidden = path
    x = torch.randn(4096, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device="cuda", requires_grad=True)
    b = torch.randn(hidden, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    g1 = torch.autograd.grad(ops.layer_norm(x, hidden, w, b, fused=True), (x, w, b), dy)
    g2 = torch.autograd.grad(ops.layer_norm(x, hidden, w, b, fused=True), (x, w, b), dy)
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)


@pytest.mark.parametrize("path", PATHS, ids=_path_id)
def test_cuda_graph_capture(path):
    # The forward, backward and finish kernels are launched with programmatic dependent
    # launch on sm_90+: such launches must be capturable (the benchmark times graphs).
    dtype, hidden = path
    x = torch.randn(512, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device="cuda", requires_grad=True)
    b = torch.randn(hidden, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        return torch.autograd.grad(ops.layer_norm(x, hidden, w, b, fused=True), (x, w, b), dy)

    graph, out = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    for a, c in zip(out, step()):
        assert torch.equal(a, c)


# The in-kernel finish (fold_finish) keeps its counter in the forward's statistics buffer
# and resets it itself: a second backward over the same saved forward (retain_graph, or
# the functional op called again) must see a zeroed counter and give the same gradients.
@pytest.mark.parametrize("hidden,rows", [(768, 65536), (1024, 16384), (1024, 5), (64, 3001), (512, 1)])
def test_repeated_backward_over_one_forward(hidden, rows):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = ops.layer_norm(x, hidden, w, b, fused=True)
    runs = [torch.autograd.grad(y, (x, w, b), dy, retain_graph=True) for _ in range(3)]
    for got in runs[1:]:
        for a, c in zip(runs[0], got):
            assert torch.equal(a, c)
    # The functional op without the counter (None) takes the finish kernel, which sums the
    # same partials in another fixed-order tree: equal up to fp32 rounding.
    ext = ops.get_extension(required=True)
    with torch.no_grad():
        _, mean, rstd, work = ext.layer_norm_forward(x, w, b, hidden, 1e-5, False)
        folded = ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, work)
        again = ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, work)
        plain = ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, None)
    for a, c, p in zip(folded, again, plain):
        assert torch.equal(a, c)
        torch.testing.assert_close(a.float(), p.float(), rtol=1e-2, atol=1e-2 * max(1.0, p.abs().max().item()))


def test_backward_work_argument_is_checked():
    ext = ops.get_extension(required=True)
    x = torch.randn(8, 64, device="cuda")
    _, mean, rstd, _ = ext.layer_norm_forward(x, None, None, 64, 1e-5, False)
    bad = torch.zeros(2, device="cuda", dtype=torch.int64)
    with pytest.raises(RuntimeError, match="work must be the one-element int32 tensor"):
        ext.layer_norm_backward(torch.ones_like(x), x, mean, rstd, None, None, 64, False, bad)


def test_error_messages_with_numbers_raise():
    # Run 8b: on the GPU machine a TORCH_CHECK message streaming a number segfaulted the
    # process; csrc/check.h's MPT_CHECK formats the parts itself.  Sizes, a dtype and a
    # device in one message each.
    ext = ops.get_extension(required=True)
    x = torch.randn(8, 64, device="cuda")
    with pytest.raises(RuntimeError, match="input with 512 elements is not a whole number of rows .* size 63"):
        ext.layer_norm_forward(x, None, None, 63, 1e-5, False)
    _, mean, rstd, _ = ext.layer_norm_forward(x, None, None, 64, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"grad_output must match .* got \[8, 32\] Float vs \[8, 64\] Float"):
        ext.layer_norm_backward(torch.ones(8, 32, device="cuda"), x, mean, rstd, None, None, 64, False, None)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor, got cpu"):
        ext.layer_norm_forward(x.cpu(), None, None, 64, 1e-5, False)


def test_module_under_half_master_weights():
    from mptrain.nn import FusedLayerNorm

    m = FusedLayerNorm(1024).cuda()  # fp32 weights, bf16 activations (the *-master case)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(m(x), reference.layer_norm(x, (1024,), m.weight, m.bias), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_drop_in_under_autocast(dtype):
    from torch import nn

    from mptrain.nn import FusedLayerNorm, FusedRMSNorm

    x = torch.randn(16, 768, device="cuda")
    for ref in (nn.LayerNorm(768).cuda(), nn.RMSNorm(768).cuda()):
        fused = (FusedLayerNorm if isinstance(ref, nn.LayerNorm) else FusedRMSNorm).from_module(ref)
        with torch.autocast("cuda", dtype=dtype):
            h = nn.functional.linear(x, torch.eye(768, device="cuda"))  # a half activation
            want, got = ref(h), fused(h)
        assert got.dtype == want.dtype, f"{type(ref).__name__}: {got.dtype} vs torch's {want.dtype}"
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
