"""mptrain.ops.dispatch: the one kernel-or-reference decision."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import dispatch


def test_fused_false_is_the_reference_and_auto_on_cpu_is_the_op_only_when_compiling():
    x = torch.randn(2, 8)
    assert dispatch.use_op("layer_norm", x, False) is False
    # eager CPU: the reference directly (the op's CPU kernel is the same code behind the dispatcher)
    assert dispatch.use_op("layer_norm", x, "auto") is False
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        seen.append(dispatch.use_op("layer_norm", t, "auto"))
        return t + 1

    f(x)
    assert seen == [True]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_wrong_fused_value_names_the_choices(bad):
    with pytest.raises(ValueError, match="fused=.*expected one of"):
        dispatch.use_op("layer_norm", torch.randn(2), bad)
    with pytest.raises(ValueError, match="FusedThing: fused="):
        dispatch.check_fused("FusedThing", bad)


def test_fused_true_on_the_cpu_raises_with_the_fix():
    with pytest.raises(RuntimeError, match="fused=True needs CUDA tensors.*fused='auto'"):
        ops.layer_norm(torch.randn(2, 8), 8, fused=True)


def test_fused_false_and_eager_cpu_call_the_reference_not_the_op(monkeypatch):
    called = []
    monkeypatch.setattr(ops.layer_norm.__globals__["reference"], "layer_norm",
                        lambda *a, **k: called.append(1) or torch.zeros(()))
    ops.layer_norm(torch.randn(2, 8), 8, fused=False)
    ops.layer_norm(torch.randn(2, 8), 8)
    assert called == [1, 1]
    # the op itself (what CUDA tensors and compiled graphs get) does not call the Python reference
    torch.ops.mptrain.layer_norm(torch.randn(2, 8), [8], None, None, 1e-5, False)
    assert called == [1, 1]


def test_cuda_without_kernels_falls_back_and_fused_true_raises(monkeypatch):
    """A CUDA tensor when the extension cannot load: "auto" takes the reference, True raises."""
    x = torch.randn(2, 8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(dispatch, "_cuda_kernels", False)
    assert dispatch.use_op("layer_norm", x, "auto") is False
    assert dispatch.use_op("layer_norm", x.double(), "auto") is False

    def fail(required):
        raise RuntimeError("build failed: see the log")

    monkeypatch.setattr(dispatch, "_load", fail)
    with pytest.raises(RuntimeError, match="build failed"):
        dispatch.use_op("layer_norm", x, True)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        dispatch.use_op("layer_norm", x.double(), True)


def test_loading_the_extension_is_a_constant_under_torch_compile(monkeypatch):
    """The first CUDA call may happen inside torch.compile: the loader runs at trace time
    and its answer is a constant, not a graph break."""
    from torch._dynamo.utils import counters

    from mptrain.ops import build

    monkeypatch.setattr(dispatch, "_cuda_kernels", None)
    monkeypatch.setattr(build, "get_extension", lambda required=False: None)
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return x + 1 if dispatch._load(False) else x - 1

    assert torch.equal(f(torch.zeros(2)), torch.full((2,), -1.0))
    assert not counters["graph_break"]


def test_call_fast_takes_eager_cuda_calls_only_and_reads_the_entry_point_by_name(monkeypatch):
    """The lean entry points' one gate: an eager call on a CUDA tensor with fused True or "auto" goes to the
    entry point as ``dispatch`` holds it now (patched here), anything else answers NotImplemented."""
    calls = []

    class CudaLike:
        is_cuda = True

    x = CudaLike()
    monkeypatch.setattr(dispatch, "fast_pool", lambda *a: calls.append(a) or "y")
    assert dispatch.call_fast("fast_pool", x, "auto", 3, 2, 1) == "y" and calls == [(x, 3, 2, 1)]
    assert dispatch.call_fast("fast_pool", x, True, 3) == "y"
    assert dispatch.call_fast("fast_pool", x, False, 3) is NotImplemented
    assert dispatch.call_fast("fast_pool", torch.ones(2), "auto", 3) is NotImplemented  # a CPU tensor
    monkeypatch.setattr(dispatch, "fast_norm", None)  # extension not loaded
    assert dispatch.call_fast("fast_norm", x, "auto", (4,)) is NotImplemented
    monkeypatch.setattr(dispatch.torch.compiler, "is_compiling", lambda: True)
    assert dispatch.call_fast("fast_pool", x, "auto", 3) is NotImplemented  # compiled code calls the op
    assert len(calls) == 2
