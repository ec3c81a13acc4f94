"""The C++ autograd of the CUDA path (csrc/ops_autograd.cpp, csrc/lstm_autograd.cu) on a
machine without a GPU: fake CUDA tensors go through the AutogradCUDA kernels and the ops'
fake kernels, and each node's backward is called directly (the autograd engine itself
needs a device). Checks which gradients come back, with which shapes and dtypes.

Runs only when the extension is already loaded in the process (it is never built here):
``python -c "import mptrain.ops as o, pytest; o.get_extension(required=True); pytest.main([...])"``.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytestmark = pytest.mark.skipif(
    not torch._C._dispatch_has_kernel_for_dispatch_key("mptrain::layer_norm", "AutogradCUDA"),
    reason="the mptrain extension is not loaded in this process")


def _meta(ts):
    return [None if t is None else (tuple(t.shape), t.dtype) for t in ts]


def _grads(node, *grads_out):
    """The node's input gradients, one per edge (a single one comes back bare)."""
    r = node(*grads_out)
    return r if isinstance(r, tuple) else (r,)


@pytest.fixture
def fake():
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def _t(*shape, dtype=torch.float32, grad=True):
    return torch.empty(*shape, device="cuda", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("params", ["wb", "w", "b", ""])
def test_norm_node(fake, params):
    x = _t(4, 64, dtype=torch.bfloat16)
    w = _t(64) if "w" in params else None
    b = _t(64) if "b" in params else None
    y, stats = torch.ops.mptrain.layer_norm(x, [64], w, b, 1e-5, False)
    assert y.grad_fn.name() == "MptLayerNormBackward" and not stats.requires_grad
    # One gradient per (input, weight, bias) position; an absent parameter's is None.
    want = [((4, 64), torch.bfloat16)] + [None if p is None else ((64,), torch.float32) for p in (w, b)]
    assert _meta(_grads(y.grad_fn, torch.ones_like(y))) == want


def test_rms_node_and_no_node_without_grad(fake):
    x, w = _t(8, 2, 32), _t(2, 32, grad=False)
    y, stats = torch.ops.mptrain.layer_norm(x, [2, 32], w, None, 1e-6, True)
    assert stats.shape == (8 + 1,)
    assert _meta(_grads(y.grad_fn, torch.ones_like(y))) == [((8, 2, 32), torch.float32), None, None]
    with torch.no_grad():
        assert torch.ops.mptrain.layer_norm(x, [2, 32], w, None, 1e-6, True)[0].grad_fn is None


@pytest.mark.parametrize("mask", [False, True])
def test_softmax_node(fake, mask):
    x = _t(2, 3, 8, 8, dtype=torch.float16)
    m = torch.zeros(2, 1, 1, 8, dtype=torch.bool, device="cuda") if mask else None
    y = torch.ops.mptrain.scaled_masked_softmax(x, m, 0.5, True)
    assert y.grad_fn.name() == "MptScaledMaskedSoftmaxBackward"
    assert _meta(_grads(y.grad_fn, torch.ones_like(y))) == [((2, 3, 8, 8), torch.float16)]


def _lstm_inputs(T, bias, grad_w=True):
    B, I, H = 2, 5, 4
    x = _t(*((T,) if T else ()), B, I)
    t = [x, _t(B, H), _t(B, H), _t(4 * H, I, grad=grad_w), _t(4 * H, H)]
    return t + [_t(4 * H) if bias[0] else None, _t(4 * H) if bias[1] else None]


@pytest.mark.parametrize("bias", [(True, True), (False, True), (True, False), (False, False)])
def test_lstm_cell_node(fake, bias):
    t = _lstm_inputs(None, bias, grad_w=False)
    h1, c1, ws = torch.ops.mptrain.lstm_cell(*t)
    assert h1.grad_fn.name() == "LSTMCellBackward" and c1.grad_fn is h1.grad_fn and not ws.requires_grad
    grads = _grads(h1.grad_fn, torch.ones_like(h1), None)
    want = [((2, 5), torch.float32), ((2, 4), torch.float32), ((2, 4), torch.float32), None,
            ((16, 4), torch.float32)] + [((16,), torch.float32) for b in bias if b]
    assert _meta(grads) == want


@pytest.mark.parametrize("bias", [(True, True), (False, True), (True, False), (False, False)])
def test_lstm_layer_node(fake, bias):
    t = _lstm_inputs(3, bias)
    out, c_n, c_all, ws = torch.ops.mptrain.lstm_layer(*t)
    assert "LSTMLayerFunction" in out.grad_fn.name() and not c_all.requires_grad and not ws.requires_grad
    grads = _grads(out.grad_fn, torch.ones_like(out), torch.ones_like(c_n), None, None)
    want = [((3, 2, 5), torch.float32), ((2, 4), torch.float32), ((2, 4), torch.float32), ((16, 5), torch.float32),
            ((16, 4), torch.float32)] + [((16,), torch.float32) for b in bias if b]
    assert _meta(grads) == want
