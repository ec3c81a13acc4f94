"""mptrain::max_pool2d on the CPU: the reference against torch's max_pool2d (values, the window
offsets against torch's indices, gradients), opcheck, fake shapes and strides, argument errors, and
the kernel-or-torch decision of mptrain.ops.max_pool2d."""
import pytest
import torch
import torch.nn.functional as F

import mptrain.ops as ops
from mptrain.ops import reference as R

OPS = torch.ops.mptrain
CL = torch.channels_last
TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
CONFIGS = [((3, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (0, 0)), ((3, 3), (1, 1), (1, 1)), ((3, 2), (2, 1), (1, 0)),
           ((5, 5), (2, 3), (2, 2))]


def _input(shape=(2, 8, 11, 10), dtype=torch.float32, specials=True, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(shape).to(dtype)
    if specials:  # a NaN, an inf, a block of ties and an all -inf channel
        x[0, 0, 1, 1] = float("nan")
        x[0, 1, 2, 2] = float("inf")
        x[1, 2, :4, :4] = 1.0
        x[1, 3] = float("-inf")
    return x.contiguous(memory_format=CL)


def _torch_pool(x, k, s, p):
    return F.max_pool2d(x, list(k), list(s), list(p), return_indices=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,s,p", CONFIGS)
def test_forward_matches_torch_and_offsets_decode_to_its_indices(dtype, k, s, p):
    x = _input(dtype=dtype)
    y, offsets = R.max_pool2d_forward(x, k, s, p)
    ref, idx = _torch_pool(x, k, s, p)
    assert y.dtype == dtype and offsets.dtype == torch.int8
    assert y.is_contiguous(memory_format=CL) and offsets.is_contiguous(memory_format=CL)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(7.0), ref.nan_to_num(7.0))
    o = offsets.long()
    rows = torch.arange(y.shape[2]).view(-1, 1) * s[0] - p[0] + o // k[1]
    cols = torch.arange(y.shape[3]).view(1, -1) * s[1] - p[1] + o % k[1]
    assert torch.equal(rows * x.shape[3] + cols, idx)
    assert 0 <= int(o.min()) and int(o.max()) < k[0] * k[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,s,p", CONFIGS)
def test_op_gradient_matches_torch(dtype, k, s, p):
    """Where windows overlap an element's gradient is a sum: fp32, rounded once (torch's bf16 kernel
    rounds after every add), so the oracle is torch's fp32 gradient in the input's dtype."""
    x = _input(dtype=dtype).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    ref, _ = _torch_pool(x32, k, s, p)
    g = torch.randn(ref.shape).to(dtype)
    (dref,) = torch.autograd.grad(ref, x32, g.float())
    y = OPS.max_pool2d(x, list(k), list(s), list(p))[0]
    (dx,) = torch.autograd.grad(y, x, g)
    assert dx.is_contiguous(memory_format=CL) and dx.dtype == dtype
    assert torch.equal(dx, dref.to(dtype))


def test_backward_sums_every_window_that_picked_an_element():
    # a constant image: every window picks its first element, several windows share some of them
    x = torch.ones(1, 1, 5, 5).contiguous(memory_format=CL)
    y, offsets = R.max_pool2d_forward(x, (3, 3), (1, 1), (1, 1))
    dx = R.max_pool2d_backward(torch.ones_like(y), offsets, [5, 5], (3, 3), (1, 1), (1, 1))
    assert dx.sum().item() == y.numel()
    assert dx[0, 0, 0, 0].item() == 4.0  # the first in-bounds element of the four windows at the corner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x = _input(dtype=dtype, specials=False).requires_grad_()
    torch.library.opcheck(OPS.max_pool2d.default, (x, [3, 3], [2, 2], [1, 1]), test_utils=TESTS)
    y, offsets = OPS.max_pool2d(x, [3, 3], [2, 2], [1, 1])
    dy = torch.randn(y.shape).to(dtype).contiguous(memory_format=CL)
    torch.library.opcheck(OPS.max_pool2d_backward.default, (dy, offsets, [11, 10], [3, 3], [2, 2], [1, 1]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_fake_gives_channels_last_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 16, 112, 112, dtype=torch.float16).contiguous(memory_format=CL)
        y, offsets = OPS.max_pool2d(x, [3, 3], [2, 2], [1, 1])
    assert tuple(y.shape) == (4, 16, 56, 56) and offsets.dtype == torch.int8
    assert y.is_contiguous(memory_format=CL) and offsets.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("k,s,p,match", [([12, 12], [1, 1], [0, 0], "127"), ([3, 3], [0, 1], [1, 1], "stride"),
                                         ([3, 3], [2, 2], [2, 2], "padding"), ([3, 3], [1, 1], [0, 0], "empty")])
def test_bad_arguments_name_the_argument(k, s, p, match):
    x = torch.randn(1, 2, 2, 2).contiguous(memory_format=CL) if match == "empty" else _input(specials=False)
    with pytest.raises(ValueError, match=match):
        OPS.max_pool2d(x, k, s, p)
    with pytest.raises(ValueError, match="4-d"):
        OPS.max_pool2d(torch.randn(2, 8, 8), [2, 2], [2, 2], [0, 0])


def test_dispatch_on_the_cpu_is_torch_in_eager_mode():
    x = _input(specials=False)
    nchw = x.contiguous()
    assert ops.max_pool2d(nchw, 3, 2, 1).is_contiguous()  # torch's pool, torch's layout
    assert torch.equal(ops.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))
    assert torch.equal(ops.max_pool2d(x, 2), F.max_pool2d(x, 2))  # stride defaults to the kernel
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.max_pool2d(x, 3, 2, 1, fused=True)
    with pytest.raises(ValueError, match="127"):
        ops.max_pool2d(x.cuda() if torch.cuda.is_available() else x, 12, 1, 0, fused=True)
    with pytest.raises(ValueError, match="fused"):
        ops.max_pool2d(x, 3, 2, 1, fused="yes")


def test_compiled_on_the_cpu_holds_the_op_without_graph_breaks():
    import torch._dynamo.testing

    x = _input(specials=False).requires_grad_()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda t: ops.max_pool2d(t, 3, 2, 1), backend=counter, fullgraph=True)
    y = f(x)
    g = torch.randn(y.shape)
    (dx,) = torch.autograd.grad(y, x, g)
    ref = F.max_pool2d(x, 3, 2, 1)
    (dref,) = torch.autograd.grad(ref, x, g)
    assert counter.frame_count == 1 and torch.equal(y, ref) and torch.equal(dx, dref)
    assert any(n.target is OPS.max_pool2d.default for n in counter.graphs[0].graph.nodes)
