"""The custom ops torch.ops.mptrain.* on CUDA: opcheck for every op, the C++ autograd
nodes, torch.compile fullgraph (aot_eager, inductor, mode="reduce-overhead") of every
mptrain.nn module and of the BERT encoder with fused LayerNorm and softmax, CUDA-graph
capture of each op's forward and backward, and autocast."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mptrain import ops
from mptrain.nn import FusedLayerNorm, FusedLSTM, FusedLSTMCell, FusedRMSNorm, FusedScaleMaskSoftmax

OPS = torch.ops.mptrain
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    ops.get_extension(required=True)
    assert ops.dispatch.use_op("layer_norm", torch.ones(1, device="cuda"), True)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=TESTS)


def _r(*shape, dtype=torch.float32, grad=False, scale=1.0):
    return (torch.randn(*shape, dtype=dtype, device="cuda") * scale).requires_grad_(grad)


def _detach(ts):
    return [t.detach() if torch.is_tensor(t) else t for t in ts]


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
def test_layer_norm_opcheck(dtype, rms, wdtype):
    wd = dtype if wdtype == "same" else torch.float32
    x, w = _r(6, 2, 64, dtype=dtype, grad=True), _r(2, 64, dtype=wd, grad=True)
    b = None if rms else _r(2, 64, dtype=wd, grad=True)
    _opcheck(OPS.layer_norm.default, (x, [2, 64], w, b, 1e-5, rms))
    y, stats = OPS.layer_norm(x, [2, 64], w, b, 1e-5, rms)
    assert stats.dtype == torch.float32 and stats.numel() == (0 if rms else 6) + 6 + 1
    _opcheck(OPS.layer_norm_backward.default, (torch.randn_like(y), *_detach([x, stats, w, b]), [2, 64], rms))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_opcheck(dtype, causal):
    x = _r(2, 3, 16, 16, dtype=dtype, grad=True)
    mask = torch.rand(2, 1, 1, 16, device="cuda") < 0.3
    _opcheck(OPS.scaled_masked_softmax.default, (x, mask, 0.125, causal))
    y = OPS.scaled_masked_softmax(x, mask, 0.125, causal)
    _opcheck(OPS.scaled_masked_softmax_backward.default, (torch.randn_like(y), y.detach(), 0.125))


def _lstm(dtype, T=None, B=4, I=24, H=32, bias=True):
    x = _r(*((T,) if T else ()), B, I, dtype=dtype, grad=True)
    t = [x, _r(B, H, dtype=dtype, grad=True), _r(B, H, dtype=dtype, grad=True),
         _r(4 * H, I, dtype=dtype, grad=True, scale=0.2), _r(4 * H, H, dtype=dtype, grad=True, scale=0.2)]
    return t + ([_r(4 * H, dtype=dtype, grad=True), _r(4 * H, dtype=dtype, grad=True)] if bias else [None, None])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_opcheck(dtype, bias):
    cell = _lstm(dtype, bias=bias)
    _opcheck(OPS.lstm_cell.default, tuple(cell))
    h1, c1, ws = OPS.lstm_cell(*cell)
    d = _detach(cell)
    _opcheck(OPS.lstm_cell_backward.default, (torch.randn_like(h1), None, *d[:5], ws.detach(), c1.detach(),
                                              [True, False, True, True, False, True]))
    layer = _lstm(dtype, T=5, bias=bias)
    _opcheck(OPS.lstm_layer.default, tuple(layer))
    out, c_n, c_all, ws = OPS.lstm_layer(*layer)
    d = _detach(layer)
    _opcheck(OPS.lstm_layer_backward.default, (torch.randn_like(out), torch.randn_like(c_n), *d[:3], out.detach(),
                                               c_all, ws, d[3], d[4], [True] * 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_tensor_opcheck(dtype):
    ts = [_r(1000 + 7 * i, dtype=dtype) for i in range(3)]
    found = torch.zeros(1, device="cuda")
    _opcheck(OPS.multi_tensor_scale_.default, (ts, [torch.empty_like(t, dtype=torch.float32) for t in ts],
                                               torch.tensor(0.5, device="cuda"), found))
    _opcheck(OPS.multi_tensor_unscale_.default, ([t.clone() for t in ts], torch.tensor(0.5, device="cuda"), found))
    _opcheck(OPS.multi_tensor_check_finite_.default, (ts, found))
    _opcheck(OPS.multi_tensor_l2norm.default, (ts, True))
    grads = [torch.randn_like(t) for t in ts]
    masters = [t.float() for t in ts] if dtype != torch.float32 else []
    steps = [torch.zeros(1, device="cuda") for _ in ts]
    state = lambda: [torch.zeros_like(t, dtype=torch.float32) for t in ts]  # noqa: E731
    for name, extra in (("multi_tensor_adam_", (0.9, 0.999, 1e-8, 0.01, True)),
                        ("multi_tensor_lamb_", (0.9, 0.999, 1e-6, 0.01, True))):
        _opcheck(getattr(OPS, name).default, (grads, [t.clone() for t in ts], state(), state(), steps, masters, 1e-3,
                                              None, *extra, False, None, found))
    _opcheck(OPS.multi_tensor_sgd_.default, (grads, [t.clone() for t in ts], state(), steps, masters, 0.1, None, 0.9,
                                             0.0, 0.0, False, False, None, found))


# ---------------------------------------------------------------- the C++ autograd nodes


def test_cuda_tensors_take_the_cpp_autograd_nodes():
    x, w = _r(4, 64, grad=True), _r(64, grad=True)
    # Not a Python BackwardCFunction: the C++ nodes of csrc/ops_autograd.cpp and lstm_autograd.cu.
    assert ops.layer_norm(x, 64, w).grad_fn.name() == "MptLayerNormBackward"
    assert ops.rms_norm(x, 64, w).grad_fn.name() == "MptLayerNormBackward"
    assert ops.scaled_masked_softmax(x.view(2, 2, 64)).grad_fn.name() == "MptScaledMaskedSoftmaxBackward"
    h, _ = ops.lstm_cell(*_lstm(torch.float32))
    assert h.grad_fn.name() == "LSTMCellBackward"
    out, _, _ = ops.lstm_layer(*_lstm(torch.float32, T=3))
    assert "CppNode" in out.grad_fn.name()


def _once_differentiable_cases():
    """(name, fn of fresh CUDA leaves -> differentiable outputs, leaves) for every C++ autograd node."""
    x, w, b = _r(4, 64, grad=True), _r(64, grad=True), _r(64, grad=True)
    s = _r(2, 2, 8, grad=True)
    return [("layer_norm", lambda x, w, b: ops.layer_norm(x, 64, w, b), [x, w, b]),
            ("rms_norm", lambda x, w: ops.rms_norm(x, 64, w), [x.detach().clone().requires_grad_(), w]),
            ("softmax", lambda s: ops.scaled_masked_softmax(s, scale=0.5), [s]),
            ("lstm_cell", lambda *a: ops.lstm_cell(*a), _lstm(torch.float32)),
            ("lstm_layer", lambda *a: ops.lstm_layer(*a)[::2], _lstm(torch.float32, T=3))]  # (out, c_n)


@pytest.mark.parametrize("case", range(5), ids=["layer_norm", "rms_norm", "softmax", "lstm_cell", "lstm_layer"])
def test_create_graph_gives_graphed_gradients_whose_backward_raises(case):
    """Under create_graph=True the C++ nodes hand back gradients with a graph (same bits as a plain backward),
    and differentiating them raises "differentiable once", as on the CPU: never gradients silently without a
    graph (a gradient penalty would then contribute nothing)."""
    name, fn, leaves = _once_differentiable_cases()[case]
    leaves = [t for t in leaves if t is not None]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cot = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, leaves, cot, retain_graph=True)
    graphed = torch.autograd.grad(outs, leaves, cot, create_graph=True)
    for p, g in zip(plain, graphed):
        assert torch.equal(p, g), name
    assert graphed[0].requires_grad and graphed[0].grad_fn is not None, name
    with pytest.raises(RuntimeError, match="differentiable once"):
        sum(g.float().square().sum() for g in graphed).backward()


@pytest.mark.parametrize("rms", [False, True])
def test_norm_gradients_match_the_reference(rms):
    x, w = _r(8, 3, 40, grad=True), _r(40, grad=True)
    b = None if rms else _r(40, grad=True)
    f = (lambda *a, fused: ops.rms_norm(a[0], 40, a[1], fused=fused)) if rms else \
        (lambda *a, fused: ops.layer_norm(a[0], 40, a[1], a[2], fused=fused))
    args = [t for t in (x, w, b) if t is not None]
    ref = [t.detach().clone().requires_grad_() for t in args]
    y, y_r = f(*args, fused=True), f(*ref, fused=False)
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    for a, e in zip(torch.autograd.grad(y, args, dy), torch.autograd.grad(y_r, ref, dy)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- torch.compile


def _compiled_matches(module, inputs, op, backend="aot_eager", mode=None, steps=1):
    torch._dynamo.reset()
    counters.clear()
    codes = []

    def record(gm, example_inputs):
        codes.append(gm.code)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(module, fullgraph=True, backend=record) if mode is None else \
        torch.compile(module, fullgraph=True, mode=mode)
    for _ in range(steps):
        out = compiled(*inputs)
    leaves = [o for o in torch.utils._pytree.tree_leaves(out)]
    eager = [o for o in torch.utils._pytree.tree_leaves(module(*inputs))]
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
    sum(o.float().sum() for o in leaves).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    if mode is None:
        assert len(codes) == 1 and f"mptrain.{op}" in codes[0], codes


MODULES = [
    ("layer_norm", lambda: FusedLayerNorm(256, device="cuda", dtype=torch.bfloat16),
     lambda: [_r(64, 256, dtype=torch.bfloat16, grad=True)]),
    ("layer_norm", lambda: FusedRMSNorm(256, device="cuda"), lambda: [_r(64, 256, grad=True)]),
    ("scaled_masked_softmax", lambda: FusedScaleMaskSoftmax(0.125, causal=True),
     lambda: [_r(2, 4, 32, 32, grad=True), torch.rand(2, 1, 1, 32, device="cuda") < 0.2]),
    ("lstm_cell", lambda: FusedLSTMCell(32, 64, device="cuda"),
     lambda: [_r(8, 32, grad=True), (_r(8, 64, grad=True), _r(8, 64, grad=True))]),
]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", range(len(MODULES)), ids=[m[0] + str(i) for i, m in enumerate(MODULES)])
def test_modules_compile_fullgraph(case, backend):
    op, make, inputs = MODULES[case]
    _compiled_matches(make(), inputs(), op, backend)


def test_fused_lstm_compiles_fullgraph():
    with torch._dynamo.config.patch(allow_rnn=True):
        _compiled_matches(FusedLSTM(32, 64, num_layers=2, impl="fused", device="cuda"), [_r(10, 8, 32, grad=True)],
                          "lstm_layer")


@pytest.mark.parametrize("case", range(len(MODULES)), ids=[m[0] + str(i) for i, m in enumerate(MODULES)])
def test_modules_compile_reduce_overhead(case):
    """torch.compile's CUDA-graph mode: the ops are capturable, replays give eager's result."""
    op, make, inputs = MODULES[case]
    _compiled_matches(make(), inputs(), op, mode="reduce-overhead", steps=3)


def test_bert_encoder_compiles_fullgraph_with_fused_layer_norm_and_softmax():
    pytest.importorskip("transformers")
    from mptrain.models.bert import build_bert_mlm
    from mptrain.nn import fuse_modules
    from mptrain.nn.attention import register_transformers_attention

    model = fuse_modules(build_bert_mlm(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                        intermediate_size=128, max_position_embeddings=64, dropout=0.0,
                                        attn_implementation=register_transformers_attention())).cuda()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = model.bert

        def forward(self, ids):
            return self.bert(input_ids=ids)[0]

    ids = torch.randint(0, 128, (4, 32), device="cuda")
    for backend in ("aot_eager", "inductor"):
        _compiled_matches(Encoder(), [ids], "layer_norm", backend)


# ---------------------------------------------------------------- CUDA graphs


CAPTURE = [
    ("layer_norm", lambda: (_r(64, 128, dtype=torch.bfloat16, grad=True), _r(128, grad=True), _r(128, grad=True)),
     lambda x, w, b: ops.layer_norm(x, 128, w, b, fused=True)),
    ("rms_norm", lambda: (_r(64, 128, dtype=torch.bfloat16, grad=True), _r(128, grad=True)),
     lambda x, w: ops.rms_norm(x, 128, w, fused=True)),
    ("softmax", lambda: (_r(2, 4, 64, 64, grad=True),),
     lambda x: ops.scaled_masked_softmax(x, None, 0.125, True, fused=True)),
    ("lstm_cell", lambda: tuple(_lstm(torch.bfloat16)), lambda *t: ops.lstm_cell(*t, fused=True)),
    ("lstm_layer", lambda: tuple(_lstm(torch.bfloat16, T=6)), lambda *t: ops.lstm_layer(*t, fused=True)[0]),
]


@pytest.mark.parametrize("case", range(len(CAPTURE)), ids=[c[0] for c in CAPTURE])
def test_forward_and_backward_capture_in_a_cuda_graph(case):
    _, make, fn = CAPTURE[case]
    inputs = [t for t in make() if t is not None]  # the graph's static input buffers
    leaves = [t for t in inputs if t.requires_grad]

    def step():
        out = fn(*inputs)
        outs = list(out) if isinstance(out, tuple) else [out]
        return outs + list(torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs]))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()  # warm-up on a side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = step()
    with torch.no_grad():
        for t in inputs:
            t.copy_(torch.randn_like(t) * 0.5)
    g.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, step()):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------- autocast


def test_norm_under_autocast_runs_in_fp32_like_torch():
    m, ref = FusedLayerNorm(64, device="cuda"), torch.nn.LayerNorm(64, device="cuda")
    x = _r(8, 64).half()
    with torch.autocast("cuda", dtype=torch.float16):
        y, y_r = m(x), ref(x)
    assert y.dtype == y_r.dtype == torch.float32
    torch.testing.assert_close(y, y_r, rtol=1e-4, atol=1e-4)


def test_lstm_cell_under_autocast_runs_in_the_autocast_dtype_like_torch():
    ref = torch.nn.LSTMCell(16, 32, device="cuda")
    cell = FusedLSTMCell.from_module(ref, fused=True)
    x, h, c = _r(4, 16), _r(4, 32), _r(4, 32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, out_r = cell(x, (h, c)), ref(x, (h, c))
    for a, e in zip(out, out_r):
        assert a.dtype == e.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2)
