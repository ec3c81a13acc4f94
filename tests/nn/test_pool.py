"""FusedMaxPool2d: a drop-in for nn.MaxPool2d on the CPU (values, gradients, configurations the kernel
does not take), fuse_modules, and torch.compile(fullgraph=True) without graph breaks."""
import pytest
import torch
from torch import nn

from mptrain.nn import FusedMaxPool2d, fuse_modules

CL = torch.channels_last


def _x(shape=(2, 8, 13, 12), seed=0):
    torch.manual_seed(seed)
    return torch.randn(shape).contiguous(memory_format=CL).requires_grad_()


@pytest.mark.parametrize("args", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2),
                                  dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0)),
                                  dict(kernel_size=3, dilation=2), dict(kernel_size=3, stride=2, ceil_mode=True)])
def test_same_values_and_gradients_as_nn_maxpool2d(args):
    x = _x()
    ours, theirs = FusedMaxPool2d(**args), nn.MaxPool2d(**args)
    y, ref = ours(x), theirs(x)
    g = torch.randn(ref.shape)
    assert torch.equal(y, ref)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def test_configurations_the_kernel_does_not_take():
    assert FusedMaxPool2d(3, dilation=2).unsupported() == "dilation=2"
    assert "ceil_mode" in FusedMaxPool2d(3, ceil_mode=True).unsupported()
    assert FusedMaxPool2d(3, 2, 1).unsupported() == ""
    y, idx = FusedMaxPool2d(2, return_indices=True)(_x())  # torch's pool, indices and all
    assert idx.dtype == torch.int64
    with pytest.raises(ValueError, match="return_indices"):
        FusedMaxPool2d(2, return_indices=True, fused=True)
    with pytest.raises(ValueError, match="fused"):
        FusedMaxPool2d(2, fused="always")


def test_fuse_modules_swaps_the_pools_it_can():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True))
    fused = fuse_modules(model)
    assert type(fused[1]) is FusedMaxPool2d and (fused[1].kernel_size, fused[1].stride) == (3, 2)
    assert type(fused[2]) is nn.MaxPool2d  # ceil_mode: left to torch
    assert type(fuse_modules(nn.MaxPool2d(2))) is FusedMaxPool2d


def test_compiles_fullgraph_without_graph_breaks():
    import torch._dynamo.testing

    pool = FusedMaxPool2d(3, 2, 1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    x = _x()
    y = torch.compile(pool, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1 and torch.equal(y, nn.MaxPool2d(3, 2, 1)(x))
