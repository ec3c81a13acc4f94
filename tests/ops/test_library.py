"""torch.library.opcheck for every op torch.ops.mptrain.* on the CPU (schema, fake
kernel, autograd registration, AOT dispatch), and the ops' gradients against the
differentiable references."""
import pytest
import torch

import mptrain.ops  # noqa: F401  (defines the ops)
from mptrain.ops import library
from mptrain.ops import reference as R

OPS = torch.ops.mptrain
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Half inputs make gradients in half: opcheck's default tolerances are for fp32.
TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs, test_utils=TESTS)


def _rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def test_every_schema_is_defined_and_has_a_cpu_kernel():
    for name in library.SCHEMAS:
        op = getattr(OPS, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layer_norm_opcheck(dtype, rms, affine):
    torch.manual_seed(0)
    x = _rand(4, 3, 8, dtype=dtype, grad=True)
    w = _rand(3, 8, dtype=dtype, grad=True) if affine[0] else None
    b = _rand(3, 8, dtype=dtype, grad=True) if affine[1] and not rms else None
    _opcheck(OPS.layer_norm.default, (x, [3, 8], w, b, 1e-5, rms))
    y, stats = OPS.layer_norm(x, [3, 8], w, b, 1e-5, rms)
    assert stats.dtype == torch.float32 and stats.shape == ((0 if rms else 4) + 4 + 1,)
    dy = torch.randn_like(y)
    # The backward ops are differentiable once only: checked with plain (non-grad) inputs.
    det = [None if t is None else t.detach() for t in (x, w, b)]
    _opcheck(OPS.layer_norm_backward.default, (dy, det[0], stats, det[1], det[2], [3, 8], rms))


def test_layer_norm_mixed_param_dtype_opcheck():
    x = _rand(6, 16, dtype=torch.bfloat16, grad=True)
    w, b = _rand(16, grad=True), _rand(16, grad=True)  # fp32 params under bf16 input (*-master)
    _opcheck(OPS.layer_norm.default, (x, [16], w, b, 1e-5, False))


@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm_gradients_match_the_reference(rms):
    torch.manual_seed(1)
    x, w, b = _rand(5, 12, dtype=torch.float64, grad=True), _rand(12, dtype=torch.float64, grad=True), None
    if not rms:
        b = _rand(12, dtype=torch.float64, grad=True)
    y = OPS.layer_norm(x, [12], w, b, 1e-5, rms)[0]
    ref = R.rms_norm(x, 12, w, 1e-5) if rms else R.layer_norm(x, 12, w, b, 1e-5)
    torch.testing.assert_close(y, ref)
    leaves = [t for t in (x, w, b) if t is not None]
    dy = torch.randn_like(y)
    for a, e in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        torch.testing.assert_close(a, e)


def test_layer_norm_names_a_wrong_normalized_shape():
    with pytest.raises(ValueError, match=r"normalized_shape=\[7\].*\[4, 8\]"):
        OPS.layer_norm(torch.randn(4, 8), [7], None, None, 1e-5, False)
    with pytest.raises(ValueError, match=r"weight has shape \[4\]"):
        OPS.layer_norm(torch.randn(4, 8), [8], torch.randn(4), None, 1e-5, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 5, 7), (2, 1, 1, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_opcheck(dtype, mask_shape, causal):
    torch.manual_seed(0)
    x = _rand(2, 3, 5, 7, dtype=dtype, grad=True)
    mask = None if mask_shape is None else torch.rand(mask_shape) < 0.3
    _opcheck(OPS.scaled_masked_softmax.default, (x, mask, 0.5, causal))
    y = OPS.scaled_masked_softmax(x, mask, 0.5, causal)
    _opcheck(OPS.scaled_masked_softmax_backward.default, (torch.randn_like(y), y.detach(), 0.5))


def test_softmax_gradient_matches_the_reference():
    torch.manual_seed(2)
    x = _rand(2, 4, 6, dtype=torch.float64, grad=True)
    mask = torch.rand(2, 1, 6) < 0.4
    y = OPS.scaled_masked_softmax(x, mask, 0.7, True)
    ref = R.scaled_masked_softmax(x, mask, 0.7, True)
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0])


def _lstm_args(dtype, B=3, I=5, H=4, bias=True, T=None):
    torch.manual_seed(0)
    x = _rand(*((T,) if T else ()), B, I, dtype=dtype, grad=True)
    h, c = _rand(B, H, dtype=dtype, grad=True), _rand(B, H, dtype=dtype, grad=True)
    w_ih, w_hh = (_rand(4 * H, n, dtype=dtype) * 0.3 for n in (I, H))
    bs = [_rand(4 * H, dtype=dtype, grad=True), _rand(4 * H, dtype=dtype, grad=True)] if bias else [None, None]
    return [x, h, c, w_ih.requires_grad_(), w_hh.requires_grad_(), *bs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell_opcheck(dtype, bias):
    args = _lstm_args(dtype, bias=bias)
    _opcheck(OPS.lstm_cell.default, tuple(args))
    h1, c1, ws = OPS.lstm_cell(*args)
    d = [t.detach() for t in args[:5]]
    for need in ([True] * 6, [False, True, False, True, False, False]):
        _opcheck(OPS.lstm_cell_backward.default,
                 (torch.randn_like(h1), None, *d, ws.detach(), c1.detach(), need))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_layer_opcheck(dtype, bias):
    args = _lstm_args(dtype, bias=bias, T=4)
    _opcheck(OPS.lstm_layer.default, tuple(args))
    out, c_n, c_all, ws = OPS.lstm_layer(*args)
    d = [t.detach() for t in args[:5]]
    _opcheck(OPS.lstm_layer_backward.default,
             (torch.randn_like(out), torch.randn_like(c_n), *d[:3], out.detach(), c_all, ws, d[3], d[4], [True] * 6))


def _mt_lists(dtype, n=3):
    torch.manual_seed(0)
    return [torch.randn(5 + i, dtype=dtype) for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_tensor_scale_family_opcheck(dtype):
    src, found = _mt_lists(dtype), torch.zeros(1)
    _opcheck(OPS.multi_tensor_scale_.default, (src, _mt_lists(torch.float32), torch.tensor(0.5), found))
    _opcheck(OPS.multi_tensor_scale_.default, (src, _mt_lists(dtype), None, None))
    _opcheck(OPS.multi_tensor_unscale_.default, (_mt_lists(dtype), torch.tensor(0.25), torch.zeros(1)))
    _opcheck(OPS.multi_tensor_check_finite_.default, (src, torch.zeros(1)))
    _opcheck(OPS.multi_tensor_l2norm.default, (src, True))
    _opcheck(OPS.multi_tensor_l2norm.default, (src, False))


def _step_state(dtype, n=3, masters=True):
    params = _mt_lists(dtype, n)
    grads = [torch.randn_like(p) for p in params]
    m = [p.float().clone() for p in params] if masters and dtype != torch.float32 else []
    return grads, params, m, [torch.zeros(1) for _ in params]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["multi_tensor_adam_", "multi_tensor_lamb_"])
def test_multi_tensor_adam_lamb_opcheck(dtype, op):
    grads, params, masters, steps = _step_state(dtype)
    ea = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    eas = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    _opcheck(getattr(OPS, op).default, (grads, params, ea, eas, steps, masters, 1e-3, None, 0.9, 0.999, 1e-8, 0.01,
                                        True, False, torch.tensor(2.0), torch.zeros(1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_tensor_sgd_opcheck(dtype):
    grads, params, masters, steps = _step_state(dtype)
    bufs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    _opcheck(OPS.multi_tensor_sgd_.default, (grads, params, bufs, steps, masters, 0.1, torch.tensor(0.05), 0.9, 0.0,
                                             1e-4, True, False, None, None))


def test_double_backward_raises_differentiable_once_on_the_cpu():
    """The CPU path's gradients under create_graph carry a graph whose backward names the limitation
    (the CUDA nodes do the same: tests/gpu/test_ops_cuda.py)."""
    x, w = _rand(4, 8, grad=True), _rand(8, grad=True)
    cell = [_rand(3, 5, grad=True), _rand(3, 6, grad=True), _rand(3, 6, grad=True), _rand(24, 5, grad=True),
            _rand(24, 6, grad=True), None, None]
    cases = [lambda: OPS.layer_norm(x, [8], w, None, 1e-5, False)[0],
             lambda: OPS.scaled_masked_softmax(x.view(2, 2, 8), None, 0.5, False),
             lambda: OPS.lstm_cell(*cell)[0]]
    for f in cases:
        y = f()
        leaves = [t for t in (x, w, *cell) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(y.square().sum(), leaves, create_graph=True, allow_unused=True)
        penalty = sum(g.square().sum() for g in grads if g is not None and g.requires_grad)
        assert torch.is_tensor(penalty)
        with pytest.raises(RuntimeError, match="differentiable once"):
            penalty.backward()
