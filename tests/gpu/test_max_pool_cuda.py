"""mptrain::max_pool2d's CUDA kernels (csrc/max_pool.cu) against the CPU reference: the output and the
window offsets bitwise, the gradient bitwise (both sum in fp32 in the same window order), over the
compile-time window shapes and the runtime loop, the 16-byte and the scalar paths, NaN / inf / ties /
all -inf windows, a batch launched in two chunks (over 2^31 threads); opcheck on CUDA; torch.compile
without graph breaks; a CUDA graph capture."""
import pytest
import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.graph_timing import capture_graph
from mptrain.nn import FusedMaxPool2d

OPS = torch.ops.mptrain
CL = torch.channels_last
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the two tiled backward shapes (3x3/2, 2x2/2, with and without padding), then the runtime loop
CONFIGS = [((3, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (0, 0)), ((2, 2), (2, 2), (1, 1)), ((3, 3), (1, 1), (1, 1)),
           ((3, 2), (2, 1), (1, 0)), ((5, 5), (2, 3), (2, 2))]
SHAPES = [(2, 64, 17, 16), (3, 3, 13, 11), (2, 12, 9, 9), (1, 8, 1, 1)]  # vector paths, C = 3, C = 12, one pixel


@pytest.fixture(scope="module", autouse=True)
def extension():
    from mptrain.ops.build import get_extension

    return get_extension(required=True)


def _input(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    if shape[1] >= 4 and shape[2] >= 4 and shape[3] >= 4:
        x[0, 0, 1, 1] = float("nan")
        x[0, 1, 2, 2] = float("inf")
        x[-1, 2, :4, :4] = 1.0
        x[-1, 3] = float("-inf")
    return x.contiguous(memory_format=CL)


def _out_size(shape, k, p):
    return all(shape[2 + i] + 2 * p[i] >= k[i] for i in (0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,s,p", CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_bitwise_the_reference(dtype, k, s, p, shape):
    if not _out_size(shape, k, p):
        pytest.skip("empty output")
    x = _input(shape, dtype)
    y_ref, off_ref = OPS.max_pool2d(x, list(k), list(s), list(p))  # the CPU kernel: the reference
    y, off = OPS.max_pool2d(x.cuda(), list(k), list(s), list(p))
    assert y.is_contiguous(memory_format=CL) and off.is_contiguous(memory_format=CL)
    assert torch.equal(y.isnan().cpu(), y_ref.isnan())
    assert torch.equal(y.cpu().nan_to_num(7.0), y_ref.nan_to_num(7.0))
    assert torch.equal(off.cpu(), off_ref)
    dy = torch.randn(y_ref.shape).to(dtype).contiguous(memory_format=CL)
    dx_ref = OPS.max_pool2d_backward(dy, off_ref, list(shape[2:]), list(k), list(s), list(p))
    dx = OPS.max_pool2d_backward(dy.cuda(), off, list(shape[2:]), list(k), list(s), list(p))
    assert torch.equal(dx.cpu(), dx_ref)


def test_stem_shape_matches_torch():
    x = torch.randn(32, 64, 112, 112, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    x.requires_grad_()
    y = ops.max_pool2d(x, 3, 2, 1)
    ref = F.max_pool2d(x, 3, 2, 1)
    g = torch.randn_like(ref)
    assert torch.equal(y, ref)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def test_misaligned_input_takes_the_scalar_path():
    base = torch.randn(2 * 16 * 9 * 9 + 1, device="cuda", dtype=torch.float16)
    x = base[1:].view(2, 9, 9, 16).permute(0, 3, 1, 2)  # channels_last, 2 bytes off 16
    assert x.is_contiguous(memory_format=CL) and x.data_ptr() % 16
    y, off = OPS.max_pool2d(x, [3, 3], [2, 2], [1, 1])
    y_ref, off_ref = OPS.max_pool2d(x.cpu(), [3, 3], [2, 2], [1, 1])
    assert torch.equal(y.cpu(), y_ref) and torch.equal(off.cpu(), off_ref)


def test_batch_past_two_to_the_31_threads_runs_in_chunks():
    # 2x2/2 over 1024x1024 single-channel fp16 images (scalar path, one thread per output element
    # forward and per 2x2 tile backward): 512 * 512 threads an image, so 8193 images are 2^31 + 2^18
    # threads and the host launches two chunks (8191 + 2).  Every window's maximum is its (1, 1)
    # element, so y, the offsets and dx are known without a reference.
    n, side = 8193, 1024
    if torch.cuda.mem_get_info()[0] < 50 * 2**30:
        pytest.skip("needs 50 GiB of free GPU memory (x and dx are 17 GB each)")
    rows = torch.arange(side, device="cuda") % 2
    pattern = (2 * rows[:, None] + rows[None, :]).half()  # 0 1 / 2 3 in every 2x2 window
    x = pattern.expand(n, 1, side, side).contiguous(memory_format=CL)
    y, off = OPS.max_pool2d(x, [2, 2], [2, 2], [0, 0])
    assert bool((y == 3).all()) and bool((off == 3).all())
    del x
    dy = torch.randn(n, 1, side // 2, side // 2, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    dx = OPS.max_pool2d_backward(dy, off, [side, side], [2, 2], [2, 2], [0, 0])
    assert torch.equal(dx[:, :, 1::2, 1::2], dy)
    dx[:, :, 1::2, 1::2] = 0
    assert not bool(dx.any())


def test_cuda_tensors_take_the_cpp_autograd_node():
    x = torch.randn(2, 8, 6, 6, device="cuda").contiguous(memory_format=CL).requires_grad_()
    y = ops.max_pool2d(x, 3, 2, 1)
    assert y.grad_fn.name() == "MptMaxPool2DBackward"  # csrc/ops_autograd.cpp, not a Python BackwardCFunction
    with torch.no_grad():
        assert ops.max_pool2d(x, 3, 2, 1).grad_fn is None


def test_create_graph_gradient_raises_when_differentiated_again():
    # dy depends on x (z = sum(y^2)): the graphed dx carries a graph whose backward raises, never a
    # gradient silently without one; its bits are the plain backward's
    x = torch.randn(2, 8, 9, 9, device="cuda").contiguous(memory_format=CL).requires_grad_()
    z = ops.max_pool2d(x, 3, 2, 1).square().sum()
    (plain,) = torch.autograd.grad(z, x, retain_graph=True)
    (graphed,) = torch.autograd.grad(z, x, create_graph=True)
    assert torch.equal(plain, graphed) and graphed.requires_grad
    with pytest.raises(RuntimeError, match="differentiable once"):
        graphed.square().sum().backward()


def test_bad_input_raises_with_the_fix():
    with pytest.raises(RuntimeError, match="channels_last"):
        OPS.max_pool2d(torch.randn(2, 8, 9, 9, device="cuda"), [3, 3], [2, 2], [1, 1])
    x = torch.randn(2, 8, 9, 9, device="cuda").contiguous(memory_format=CL)
    y, off = OPS.max_pool2d(x, [3, 3], [2, 2], [1, 1])
    with pytest.raises(RuntimeError, match="does not pool"):
        OPS.max_pool2d_backward(y, off, [19, 9], [3, 3], [2, 2], [1, 1])
    with pytest.raises(RuntimeError, match="int8"):
        OPS.max_pool2d_backward(y, off.float(), [9, 9], [3, 3], [2, 2], [1, 1])


def test_opcheck_cuda():
    x = torch.randn(2, 16, 11, 10, device="cuda").contiguous(memory_format=CL).requires_grad_()
    torch.library.opcheck(OPS.max_pool2d.default, (x, [3, 3], [2, 2], [1, 1]))


def test_compiled_module_has_no_graph_break_and_matches_eager():
    import torch._dynamo.testing

    pool = FusedMaxPool2d(3, 2, 1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    x = torch.randn(4, 32, 28, 28, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL).requires_grad_()
    f = torch.compile(pool, backend=counter, fullgraph=True)
    y = f(x)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    ref = F.max_pool2d(x, 3, 2, 1)
    assert counter.frame_count == 1
    assert torch.equal(y, ref) and torch.equal(dx, torch.autograd.grad(ref, x, g)[0])


def test_cuda_graph_capture_replays_forward_and_backward():
    x = torch.randn(4, 64, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    x.requires_grad_()
    g = torch.randn(4, 64, 16, 16, device="cuda", dtype=torch.float16)

    def step():
        y = ops.max_pool2d(x, 3, 2, 1)
        return y, torch.autograd.grad(y, x, g)[0]

    graph, (y, dx) = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    ref = F.max_pool2d(x, 3, 2, 1)
    assert torch.equal(y, ref)
    assert torch.equal(dx, torch.autograd.grad(ref, x, g)[0])
