"""The lean entry points (csrc/fast_call.cpp) behind ``ops.layer_norm`` / ``ops.rms_norm`` and
``ops.max_pool2d`` on CUDA tensors: taken for plain eager calls, bitwise the op's results and gradients,
and declined (the torch.ops path) under a torch-function mode and CUDA autocast."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import dispatch
from mptrain.ops.library import OPS



@pytest.fixture(scope="module", autouse=True)
def extension():
    from mptrain.ops.build import get_extension

    get_extension(required=True)
    ops.layer_norm(torch.ones(1, 8, device="cuda"), (8,), fused=True)  # the first call loads the fast path
    assert dispatch.fast_norm is not None and dispatch.fast_pool is not None


def _count(monkeypatch, name):
    """Wraps the entry point ``dispatch.<name>``; the list records, per call, whether it took the call
    (did not answer NotImplemented)."""
    taken, real = [], getattr(dispatch, name)

    def fast(*args):
        y = real(*args)
        taken.append(y is not NotImplemented)
        return y

    monkeypatch.setattr(dispatch, name, fast)
    return taken


@pytest.fixture
def counted(monkeypatch):
    return _count(monkeypatch, "fast_norm")


def _leaves(dtype, wdtype, rms):
    x = torch.randn(64, 1024, dtype=dtype, device="cuda", requires_grad=True)
    w = torch.randn(1024, dtype=wdtype, device="cuda", requires_grad=True)
    b = None if rms else torch.randn(1024, dtype=wdtype, device="cuda", requires_grad=True)
    return x, w, b


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16), (torch.float32, torch.float32)])
def test_fast_path_is_the_op_bitwise(counted, rms, dtype, wdtype):
    x, w, b = _leaves(dtype, wdtype, rms)
    eps = torch.finfo(torch.float32).eps if rms else 1e-5
    y = ops.rms_norm(x, (1024,), w) if rms else ops.layer_norm(x, (1024,), w, b)
    assert counted == [True]
    y2 = OPS["layer_norm"](x, [1024], w, b, eps, rms)[0]
    assert y.dtype == dtype and torch.equal(y, y2)
    dy = torch.randn_like(y)
    leaves = [t for t in (x, w, b) if t is not None]
    for g, g2 in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y2, leaves, dy)):
        assert torch.equal(g, g2)


def test_torch_function_mode_sees_the_op(counted):
    seen = []

    class Log(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w, b = _leaves(torch.bfloat16, torch.bfloat16, False)
    with Log():
        y = ops.layer_norm(x, (1024,), w, b)
    assert counted == [False] and torch.ops.mptrain.layer_norm.default in seen
    assert torch.equal(y, OPS["layer_norm"](x, [1024], w, b, 1e-5, False)[0])


def test_cuda_autocast_takes_the_upcasting_path(counted):
    x, w, b = _leaves(torch.bfloat16, torch.bfloat16, False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ops.layer_norm(x, (1024,), w, b)
    assert counted == [False] and y.dtype == torch.float32  # as F.layer_norm under CUDA autocast


def test_compiled_code_calls_the_op_not_the_entry_point(counted):
    x, w, b = _leaves(torch.bfloat16, torch.bfloat16, False)
    f = torch.compile(lambda t: ops.layer_norm(t, (1024,), w, b), fullgraph=True, backend="aot_eager")
    y = f(x)
    assert counted == [] and torch.equal(y, OPS["layer_norm"](x, [1024], w, b, 1e-5, False)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pool_fast_path_is_the_op_bitwise(monkeypatch, dtype):
    taken = _count(monkeypatch, "fast_pool")
    x = torch.randn(4, 64, 28, 28, dtype=dtype, device="cuda").contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = ops.max_pool2d(x, 3, 2, 1)
    assert taken == [True] and y.grad_fn.name() == "MptMaxPool2DBackward"
    y2 = OPS["max_pool2d"](x, [3, 3], [2, 2], [1, 1])[0]
    assert torch.equal(y, y2)
    dy = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y2, x, dy)[0])
    ops.max_pool2d(x.contiguous(), 3, 2, 1)  # NCHW: declined, torch's pool
    assert taken == [True, False]
