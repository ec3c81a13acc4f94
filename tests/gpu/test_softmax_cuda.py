"""The fused scaled masked softmax kernels against the reference and float64, on the GPU.

Awkward row lengths (1, odd, not a multiple of the vector width, up to 40000), every
broadcast mask layout (over heads, padding masks, key-broadcast, transposed, misaligned),
causal with Sq != Sk, fully masked rows, misaligned inputs, NaN-poisoned outputs.
"""
import pytest
import torch

from mptrain import ops
from mptrain.bench.graph_timing import capture_graph

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS = [1, 7, 64, 100, 512, 1000, 2048, 4096, 8192, 16384, 20000, 32768, 40000]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def extension():
    from mptrain.ops.build import get_extension

    return get_extension(required=True)


def check(out, ref, truth, what):
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten, or NaN from a masked row)"
    tol = TOL[out.dtype] * max(1.0, truth.abs().max().item())
    diff = (out.double() - ref.double()).abs().max().item()
    assert diff <= tol, f"{what}: max |kernel - reference| = {diff:.3g} > {tol:.3g}"
    e_out = (out.double() - truth).abs().max().item()
    e_ref = (ref.double() - truth).abs().max().item()
    assert e_out <= 2 * e_ref + tol, f"{what}: error vs float64 {e_out:.3g}, reference's {e_ref:.3g}"


def compare(x, mask, scale, causal, what):
    x = x.detach().requires_grad_()
    dy = torch.randn(x.shape, device="cuda").to(x.dtype)
    blocks = [torch.full((x.numel(),), float("nan"), dtype=x.dtype, device="cuda") for _ in range(2)]
    del blocks  # the outputs allocated next land on NaN: unwritten elements are caught
    y = ops.scaled_masked_softmax(x, mask, scale, causal, fused=True)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    y_ref = ops.scaled_masked_softmax(x, mask, scale, causal, fused=False)
    (dx_ref,) = torch.autograd.grad(y_ref, (x,), dy)
    x64 = x.detach().double().requires_grad_()
    y64 = ops.scaled_masked_softmax(x64, mask, scale, causal, fused=False)
    (dx64,) = torch.autograd.grad(y64, (x64,), dy.double())
    check(y, y_ref, y64, f"{what} y")
    check(dx, dx_ref, dx64, f"{what} dx")


def masks(b, h, sq, sk, gen):
    """Mask layouts for [b, h, sq, sk] scores, each with some fully masked rows."""
    def rnd(*shape):
        return torch.rand(shape, device="cuda", generator=gen) < 0.3

    over_heads = rnd(b, 1, sq, sk)
    over_heads[0, 0, 0] = True  # a fully masked row
    padding = rnd(b, 1, 1, sk)
    padding[-1] = True  # a fully masked batch
    full = rnd(b, h, sq, sk)
    key_bcast = rnd(b, h, sq, 1)  # whole rows on / off: key stride 0
    transposed = rnd(b, 1, sk, sq).transpose(-1, -2)  # key stride != 1
    misaligned = rnd(b * sq * sk + 1)[1:].view(b, 1, sq, sk)  # storage offset 1
    return {
        "none": None, "over_heads": over_heads, "padding": padding, "shared": rnd(1, 1, sq, sk),
        "keys_1d": rnd(sk), "full": full, "key_bcast": key_bcast, "transposed": transposed,
        "misaligned": misaligned,
    }


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("sk", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_reference_and_float64(dtype, sk, causal):
    gen = torch.Generator(device="cuda").manual_seed(sk)
    b, h, sq = (2, 3, 5) if sk <= 4096 else (2, 2, 3)
    x = (torch.randn(b, h, sq, sk, device="cuda", generator=gen) * 3).to(dtype)
    for name, mask in masks(b, h, sq, sk, gen).items():
        compare(x, mask, 0.125 if sk > 1 else 1.0, causal, f"S={sk} mask={name}")


@pytest.mark.parametrize("sk", [64, 264, 512, 520, 1000, 1032, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_launch_layouts(dtype, sk):
    # Every forward layout (lean, two rows per warp, persistent, row table) at the edges of
    # their lengths (33..64 and 129..256 vectors), with an odd number of rows (partial
    # blocks) and 3 heads (two-row warps that straddle two mask rows reload the mask).
    gen = torch.Generator(device="cuda").manual_seed(sk)
    b, h, sq = 3, 3, 7
    x = (torch.randn(b, h, sq, sk, device="cuda", generator=gen) * 3).to(dtype)
    for name in ("none", "over_heads", "padding", "key_bcast"):
        mask = masks(b, h, sq, sk, gen)[name]
        for causal in (False, True):
            compare(x, mask, 0.125, causal, f"S={sk} mask={name} causal={causal}")


@pytest.mark.parametrize("b,h,s", [(2, 16, 512), (1, 8, 2048)])
def test_many_rows(b, h, s):
    # More rows than the persistent grid holds at once (~132 x 16 blocks x 4 rows):
    # every group walks several rows.
    gen = torch.Generator(device="cuda").manual_seed(s)
    x = (torch.randn(b, h, s, s, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    mask = torch.rand(b, 1, s, s, device="cuda", generator=gen) < 0.1
    mask[0, 0, 3] = True  # a fully masked row
    compare(x, mask, 0.125, False, f"{b}x{h}x{s} masked")
    compare(x, None, 0.125, True, f"{b}x{h}x{s} causal")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_causal_rectangular_and_misaligned_input(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for sq, sk in [(3, 64), (64, 3), (17, 1024)]:
        x = torch.randn(2, 4, sq, sk, device="cuda", generator=gen).to(dtype)
        compare(x, None, 1.0, True, f"causal {sq}x{sk}")
    base = torch.randn(4 * 256 + 1, device="cuda", generator=gen).to(dtype)
    compare(base[1:].view(4, 256), None, 0.5, False, "misaligned input")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fully_masked_rows_are_zero_with_zero_grad(dtype):
    x = torch.randn(2, 4, 8, 512, device="cuda").to(dtype).requires_grad_()
    mask = torch.zeros(2, 1, 8, 512, dtype=torch.bool, device="cuda")
    mask[1] = True
    y = ops.scaled_masked_softmax(x, mask, 0.1, fused=True)
    (dx,) = torch.autograd.grad(y, (x,), torch.randn_like(y))
    assert (y[1] == 0).all() and (dx[1] == 0).all() and torch.isfinite(dx).all()
    torch.testing.assert_close(y[0].float().sum(-1), torch.ones(4, 8, device="cuda"), rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype,s", [(torch.bfloat16, 512), (torch.float32, 256), (torch.bfloat16, 2048),
                                     (torch.bfloat16, 1024)], ids=["lean", "pair", "persist", "rows"])
def test_cuda_graph_capture(dtype, s):
    x = torch.randn(4, 8, 128, s, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.rand(4, 1, 128, s, device="cuda") < 0.2
    dy = torch.randn_like(x)

    def step():
        return torch.autograd.grad(ops.scaled_masked_softmax(x, mask, 0.1, True, fused=True), (x,), dy)[0]

    graph, out = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, step())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("b,h,s", [(2, 16, 512), (3, 5, 512), (2, 3, 264), (1, 7, 392)])
def test_lean_forward(dtype, b, h, s):
    # The lean forwards mask on raw 16-bit words and take the max before scaling: check
    # them where that could go wrong.  Odd head counts (row pairs straddling two mask
    # rows), 33..64-vector rows with idle lanes, fully masked rows (zeros, zero grad),
    # mask bytes other than 0/1 (a bool view of uint8 2s: true, as in torch), mask and
    # causal together, large logits, and a negative scale (takes the two-row layout).
    gen = torch.Generator(device="cuda").manual_seed(s + h)
    x = (torch.randn(b, h, s, s, device="cuda", generator=gen) * 3).to(dtype)
    x[0, 0, 1, :8] = 60.0  # large logits: exp(scale * (x - max)) must not overflow
    mask = torch.rand(b, 1, s, s, device="cuda", generator=gen) < 0.2
    mask[0, 0, 2] = True  # a fully masked row
    for m, causal in ((mask, False), (None, True), (mask, True), (None, False)):
        compare(x, m, 0.125, causal, f"{b}x{h}x{s} mask={m is not None} causal={causal}")
    compare(x, mask, -0.5, False, f"{b}x{h}x{s} negative scale")
    y = ops.scaled_masked_softmax(x, mask, 0.125, fused=True)
    assert (y[0, :, 2] == 0).all(), "fully masked row must be zeros"
    # Bool bytes other than 0/1 (a uint8 view) count as True: same output as the clean mask.
    raw = mask.to(torch.uint8) * torch.randint(1, 256, mask.shape, device="cuda", generator=gen, dtype=torch.uint8)
    y_raw = ops.scaled_masked_softmax(x, raw.view(torch.bool), 0.125, fused=True)
    assert torch.equal(y_raw, y), "mask bytes > 1 must act as True"
