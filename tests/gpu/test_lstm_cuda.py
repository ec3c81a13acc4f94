"""CUDA: the fused LSTM kernels against their references and against float64, on awkward
sizes, every storage dtype, poisoned output memory, and gradients through autograd."""
import pytest
import torch
from torch import nn

from mptrain import ops as mptrain_ops
from mptrain.ops import lstm as lstm_ops
from mptrain.ops import reference
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.bench.graph_timing import capture_graph

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) for kernel vs reference on the same inputs: both compute in fp32 and round
# once, so they differ by about one unit in the last place of the storage dtype.
SAME_INPUT_TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Relative error in norm for end-to-end results vs float64 (GEMMs in the storage dtype).
NORM_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SIZES = [(1, 1), (3, 3), (5, 1023), (2, 17), (7, 8), (64, 1024), (33, 40)]


@pytest.fixture(scope="module")
def ext():
    e = mptrain_ops.get_extension()
    if e is None:
        pytest.fail("the mptrain extension did not load on a CUDA machine; see mptrain.ops.extension_status()")
    return e


def norm_tol(dtype):
    """NORM_TOL, loosened for fp32 when the session allows TF32 GEMMs."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return 3e-3
    return NORM_TOL[dtype]


def rel_err(a, b):
    """||a - b|| / ||b||, with ||b|| floored at 0.1 per element (rms).

    The rounding error of these ops is absolute, about eps x the O(1) gate pre-activations
    and cell states, not relative to each result: a single near-zero output (f*c + i*g
    cancelling, as in the 1x1x1 cases) has a large relative error in any precision. The
    floor only matters where the reference's rms is below 0.1; a wrong value still gives
    an O(1) error."""
    a, b = a.double(), b.double()
    floor = 0.1 * max(1, b.numel()) ** 0.5
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def poison(numels, dtype):
    """Fill freed allocator blocks of these sizes with NaN so that an output element the
    kernel forgets to write shows up as NaN instead of a lucky zero."""
    blocks = [torch.full((n,), float("nan"), dtype=dtype, device="cuda") for n in numels for _ in range(4)]
    del blocks


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", SIZES)
@pytest.mark.parametrize("variant", ["two_gates_two_biases", "one_gate_no_bias", "misaligned"])
def test_pointwise_forward_matches_reference(ext, dtype, B, H, variant):
    torch.manual_seed(B * 1000 + H)
    ig = randn(B, 4 * H, dtype=dtype, scale=2)
    hg = randn(B, 4 * H, dtype=dtype) if variant != "one_gate_no_bias" else None
    b1 = randn(4 * H, dtype=dtype) if variant != "one_gate_no_bias" else None
    b2 = randn(4 * H, dtype=dtype) if variant != "one_gate_no_bias" else None
    c = randn(B, H, dtype=dtype, scale=2)
    if variant == "misaligned":  # offset views: forces the scalar (unvectorised) path
        ig = randn(B * 4 * H + 1, dtype=dtype)[1:].view(B, 4 * H)
        b1 = randn(4 * H + 1, dtype=dtype)[1:]
    poison([B * H, B * 4 * H], dtype)
    h1, c1, ws = ext.lstm_cell_pointwise_forward(ig, hg, c, b1, b2)
    rh, rc, rws = reference.lstm_cell_pointwise_forward(ig, hg, c, b1, b2)
    rtol, atol = SAME_INPUT_TOL[dtype]
    for got, want in ((h1, rh), (c1, rc), (ws, rws)):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # Against float64 math on the same (rounded) inputs: only the output rounding remains.
    d = lambda t: None if t is None else t.double()  # noqa: E731
    fh, fc, _ = reference.lstm_cell_pointwise_forward(d(ig), d(hg), d(c), d(b1), d(b2))
    torch.testing.assert_close(h1.double(), fh, rtol=rtol, atol=atol)
    torch.testing.assert_close(c1.double(), fc, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", SIZES)
@pytest.mark.parametrize("grads", ["dh_dh2_dc", "dh_only", "dc_only", "none"])
def test_pointwise_backward_matches_reference(ext, dtype, B, H, grads):
    torch.manual_seed(B * 7 + H)
    ig, c = randn(B, 4 * H, dtype=dtype, scale=2), randn(B, H, dtype=dtype)
    _, c1, ws = ext.lstm_cell_pointwise_forward(ig, None, c, None, None)
    dh = randn(B, H, dtype=dtype) if "dh" in grads else None
    dh2 = randn(B, H, dtype=dtype) if "dh2" in grads else None
    dc = randn(B, H, dtype=dtype) if "dc" in grads else None
    poison([B * H, B * 4 * H], dtype)
    dg, dcp = ext.lstm_cell_pointwise_backward(dh, dh2, dc, c, c1, ws)
    rdg, rdcp = reference.lstm_cell_pointwise_backward(dh, dh2, dc, c, c1, ws)
    rtol, atol = SAME_INPUT_TOL[dtype]
    for got, want in ((dg, rdg), (dcp, rdcp)):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    if grads == "none":
        assert (dg == 0).all() and (dcp == 0).all()


def _cell_inputs(B, I, H, dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    k = 1 / H**0.5
    t = dict(device="cuda", dtype=torch.float64)
    x, h, c = torch.randn(B, I, **t), torch.randn(B, H, **t), torch.randn(B, H, **t)
    w = [torch.empty(4 * H, n, **t).uniform_(-k, k) for n in (I, H)]
    b = [torch.empty(4 * H, **t).uniform_(-k, k) for _ in range(2)] if bias else [None, None]
    return [x, h, c] + w + b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,I,H", [(1, 1, 1), (3, 5, 3), (17, 30, 1023), (64, 256, 1024), (4, 8, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_cell_autograd_vs_reference_and_float64(ext, dtype, B, I, H, bias):
    exact = _cell_inputs(B, I, H, dtype, bias)
    ours = [None if t is None else t.to(dtype).requires_grad_() for t in exact]
    ref = [None if t is None else t.to(dtype).requires_grad_() for t in exact]
    f64 = [None if t is None else t.clone().requires_grad_() for t in exact]
    out_o = lstm_ops.lstm_cell(*ours, fused=True)
    out_r = reference.lstm_cell(*ref)
    out_x = reference.lstm_cell(*f64)
    cot = [torch.randn_like(t) for t in out_x]
    for o, r, x in zip(out_o, out_r, out_x):
        assert o.dtype == dtype and torch.isfinite(o).all()
        assert rel_err(o, x) < norm_tol(dtype)
        assert rel_err(o, r) < norm_tol(dtype)
    leaves = lambda ts: [t for t in ts if t is not None]  # noqa: E731
    g_o = torch.autograd.grad(out_o, leaves(ours), [t.to(dtype) for t in cot])
    g_r = torch.autograd.grad(out_r, leaves(ref), [t.to(dtype) for t in cot])
    g_x = torch.autograd.grad(out_x, leaves(f64), cot)
    for name, o, r, x in zip(["x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh"], g_o, g_r, g_x):
        assert o.dtype == dtype, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, x) < 2 * norm_tol(dtype), (name, rel_err(o, x))
        assert rel_err(o, r) < 2 * norm_tol(dtype), (name, rel_err(o, r))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,B,I,H", [(1, 1, 1, 1), (5, 3, 7, 3), (9, 4, 16, 1023), (16, 8, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_autograd_vs_reference_and_float64(ext, dtype, T, B, I, H, bias):
    exact = _cell_inputs(B, I, H, dtype, bias, seed=T)
    exact[0] = torch.randn(T, B, I, device="cuda", dtype=torch.float64)
    ours = [None if t is None else t.to(dtype).requires_grad_() for t in exact]
    f64 = [None if t is None else t.clone().requires_grad_() for t in exact]
    out_o, h_o, c_o = lstm_ops.lstm_layer(*ours, fused=True)
    out_x, h_x, c_x = lstm_ops.lstm_layer(*f64)  # float64 on CUDA -> reference
    tol = norm_tol(dtype) * (3 if dtype != torch.float32 else 10)  # error grows along the sequence
    for o, x in ((out_o, out_x), (h_o, h_x), (c_o, c_x)):
        assert o.dtype == dtype and torch.isfinite(o).all()
        assert rel_err(o, x) < tol, rel_err(o, x)
    cot = [torch.randn_like(out_x), torch.randn_like(c_x)]
    leaves = lambda ts: [t for t in ts if t is not None]  # noqa: E731
    g_o = torch.autograd.grad((out_o, c_o), leaves(ours), [t.to(dtype) for t in cot])
    g_x = torch.autograd.grad((out_x, c_x), leaves(f64), cot)
    for name, o, x in zip(["x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh"], g_o, g_x):
        assert o.dtype == dtype and torch.isfinite(o).all(), name
        assert rel_err(o, x) < 2 * tol, (name, rel_err(o, x))


def test_layer_partial_gradients(ext):
    """Only c_n used, only some inputs requiring grad: undefined grads are handled."""
    T, B, I, H = 6, 3, 5, 7
    x = torch.randn(T, B, I, device="cuda", requires_grad=True)
    h0, c0 = torch.randn(B, H, device="cuda"), torch.randn(B, H, device="cuda")
    w_ih = torch.randn(4 * H, I, device="cuda", requires_grad=True)
    w_hh = torch.randn(4 * H, H, device="cuda")
    _, _, c_n = lstm_ops.lstm_layer(x, h0, c0, w_ih, w_hh, fused=True)
    gx, gw = torch.autograd.grad(c_n.sum(), (x, w_ih))
    x2, w2 = x.detach().double().requires_grad_(), w_ih.detach().double().requires_grad_()
    _, _, c_r = lstm_ops.lstm_layer(x2, h0.double(), c0.double(), w2, w_hh.double())
    rx, rw = torch.autograd.grad(c_r.sum(), (x2, w2))
    assert rel_err(gx, rx) < 10 * norm_tol(torch.float32) and rel_err(gw, rw) < 10 * norm_tol(torch.float32)


@pytest.mark.parametrize("batch_first", [False, True])
def test_fused_lstm_matches_cudnn(ext, batch_first):
    torch.manual_seed(0)
    ref = nn.LSTM(24, 33, num_layers=2, batch_first=batch_first, device="cuda")
    ours = FusedLSTM(24, 33, num_layers=2, batch_first=batch_first, device="cuda", impl="fused")
    ours.load_state_dict(ref.state_dict())
    assert FusedLSTM(24, 33, device="cuda").resolved_impl(torch.randn(2, 2, 24, device="cuda")) in ("cudnn", "fused")
    x = torch.randn((5, 11, 24) if batch_first else (11, 5, 24), device="cuda", requires_grad=True)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # cuDNN in true fp32
        out_r, (h_r, c_r) = ref(x)
        g_r = torch.autograd.grad((out_r.sum() + c_r.sum()), [x, *ref.parameters()])
    out_o, (h_o, c_o) = ours(x)
    for o, r in ((out_o, out_r), (h_o, h_r), (c_o, c_r)):
        assert rel_err(o, r) < 10 * norm_tol(torch.float32)
    g_o = torch.autograd.grad((out_o.sum() + c_o.sum()), [x, *ours.parameters()])
    for o, r in zip(g_o, g_r):
        assert rel_err(o, r) < 10 * norm_tol(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_lstmcell_module_on_cuda(ext, dtype):
    torch.manual_seed(0)
    ref = nn.LSTMCell(10, 20, device="cuda", dtype=dtype)
    ours = FusedLSTMCell(10, 20, device="cuda", dtype=dtype, fused=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 10, device="cuda", dtype=dtype)
    for o, r in zip(ours(x), ref(x)):
        assert rel_err(o, r) < norm_tol(dtype)


def test_cell_under_autocast_runs_in_the_autocast_dtype(ext):
    cell = FusedLSTMCell(8, 16, device="cuda", fused=True)
    x = torch.randn(4, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h, c = cell(x)
    assert h.dtype == torch.bfloat16
    h.float().sum().backward()
    assert cell.weight_ih.grad.dtype == torch.float32


def test_mixed_dtypes_give_a_clear_error(ext):
    x, h = torch.randn(2, 3, device="cuda"), torch.randn(2, 4, device="cuda")
    c = torch.randn(2, 4, device="cuda", dtype=torch.float16)
    w_ih, w_hh = torch.randn(16, 3, device="cuda"), torch.randn(16, 4, device="cuda")
    with pytest.raises(RuntimeError, match="'c' has dtype"):
        lstm_ops.lstm_cell(x, h, c, w_ih, w_hh, fused=True)


def test_cell_forward_is_cuda_graph_capturable(ext):
    B, I, H = 8, 16, 32
    args = [t.float() if t is not None else None for t in _cell_inputs(B, I, H, torch.float32)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        lstm_ops.lstm_cell(*args, fused=True)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        h_g, c_g = lstm_ops.lstm_cell(*args, fused=True)
    args[0].copy_(torch.randn_like(args[0]))
    g.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        h_e, c_e = lstm_ops.lstm_cell(*args, fused=True)
    torch.testing.assert_close(h_g, h_e)
    torch.testing.assert_close(c_g, c_e)


def test_cell_module_fwd_bwd_fast_path_and_cuda_graph(ext):
    """FusedLSTMCell(x, (h, c)) takes the module's direct path to the C++ node; it
    must match the reference, and its fwd + autograd.grad must capture in a CUDA graph
    (the benchmark's "[CUDA graph: GPU time]" rows rely on it) and replay new inputs."""
    torch.manual_seed(0)
    B, I, H = 8, 16, 32
    cell = FusedLSTMCell(I, H, device="cuda", fused=True)
    params = list(cell.parameters())
    xhc = [torch.randn(B, n, device="cuda", requires_grad=True) for n in (I, H, H)]
    cot = [torch.randn(B, H, device="cuda") for _ in range(2)]

    def step():
        out = cell(xhc[0], (xhc[1], xhc[2]))
        return list(out) + list(torch.autograd.grad(out, xhc + params, cot))

    f64 = [t.detach().double().requires_grad_() for t in xhc + params]
    want_out = reference.lstm_cell(*f64)
    want = list(want_out) + list(torch.autograd.grad(want_out, f64, [t.double() for t in cot]))
    for got, w in zip(step(), want):
        assert rel_err(got, w) < 10 * norm_tol(torch.float32)

    g, captured = capture_graph(step)
    with torch.no_grad():
        for t in xhc:
            t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    for got, w in zip(captured, step()):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", ["x", "h", "c", "w", "b", "xc", "all"])
@pytest.mark.parametrize("used", ["h", "c", "both"])
def test_cell_partial_gradients(ext, mask, used):
    """The C++ autograd node: only the requested gradients, unused outputs (undefined grads)."""
    exact = _cell_inputs(5, 6, 8, torch.float32)
    names = ["x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh"]
    want = {"x": ["x"], "h": ["h"], "c": ["c"], "w": ["w_ih", "w_hh"], "b": ["b_ih", "b_hh"],
            "xc": ["x", "c"], "all": names}[mask]
    ours = [t.float().requires_grad_(n in want) for n, t in zip(names, exact)]
    f64 = [t.clone().requires_grad_(n in want) for n, t in zip(names, exact)]
    pick = {"h": [0], "c": [1], "both": [0, 1]}[used]
    out_o = lstm_ops.lstm_cell(*ours, fused=True)
    out_x = reference.lstm_cell(*f64)
    assert out_o[0].grad_fn is not None and type(out_o) is tuple
    cot = [torch.randn(5, 8, device="cuda", dtype=torch.float64) for _ in pick]
    g_o = torch.autograd.grad([out_o[k] for k in pick], [t for t in ours if t.requires_grad], [t.float() for t in cot])
    g_x = torch.autograd.grad([out_x[k] for k in pick], [t for t in f64 if t.requires_grad], cot)
    for o, x in zip(g_o, g_x):
        assert rel_err(o, x) < 10 * norm_tol(torch.float32)


def test_cell_without_grad_builds_no_graph(ext):
    args = [t.float() for t in _cell_inputs(3, 4, 8, torch.float32)]
    args[3].requires_grad_()
    with torch.no_grad():
        h, c = lstm_ops.lstm_cell(*args, fused=True)
    assert h.grad_fn is None and not h.requires_grad


def test_fused_lstm_bf16_weights_are_flat_for_cudnn(ext):
    """torch leaves bf16 nn.LSTM weights scattered (cuDNN copies them at every call);
    FusedLSTM flattens them, and gives nn.LSTM's results."""
    import warnings

    torch.manual_seed(0)
    ref = nn.LSTM(16, 32, num_layers=2, device="cuda", dtype=torch.bfloat16)
    ours = FusedLSTM(16, 32, num_layers=2, device="cuda", dtype=torch.bfloat16, impl="cudnn")
    ours.load_state_dict(ref.state_dict())
    ptrs = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    assert len(ptrs) == 1, "FusedLSTM bf16 weights are not in one cuDNN buffer"
    x = torch.randn(7, 3, 16, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_o, (h_o, c_o) = ours(x)
    assert not [w for w in caught if "contiguous chunk" in str(w.message)], [str(w.message) for w in caught]
    out_r, (h_r, c_r) = ref(x)
    for o, r in ((out_o, out_r), (h_o, h_r), (c_o, c_r)):
        assert rel_err(o, r) < norm_tol(torch.bfloat16)


# ---------------------------------------------------------------- direct cuBLAS
# For fp16/bf16 the LSTM GEMMs call cublasGemmEx directly (csrc/cublas_gemm.cuh) with the
# arguments at::mm would pass: same handle, operands, op flags, m/n/k, leading
# dimensions, compute type, algo and math mode. cuBLAS is deterministic for identical
# arguments on one GPU, so the results are expected to be BITWISE equal to torch.mm /
# addmm_ whenever every GEMM dimension is >= 2. With a size-1 dimension torch may read a
# degenerate operand in the other orientation (a different, equally valid call): there
# we only ask for about one rounding of the storage dtype.

HALF_DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(params=[False, True], ids=["no_reduced_reduction", "reduced_reduction"])
def reduced_reduction(request):
    """Both settings of allow_{fp16,bf16}_reduced_precision_reduction, restored after."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    m.allow_fp16_reduced_precision_reduction = request.param
    m.allow_bf16_reduced_precision_reduction = request.param
    yield request.param
    m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved


def assert_same(got, want, exact, name=""):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if exact:
        assert torch.equal(got, want), (name, (got.double() - want.double()).abs().max().item())
    else:
        rtol, atol = SAME_INPUT_TOL[got.dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)


def _padded(rows, cols, pad, dtype):
    """A (rows, cols) view with row stride cols + pad (pad 0: contiguous)."""
    return randn(rows, cols + pad, dtype=dtype)[:, :cols]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("M,N,K", [(5, 7, 3), (64, 96, 48), (33, 40, 17), (1, 40, 24), (33, 1, 17), (13, 21, 1)])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_rm_is_torch_mm_bitwise(ext, reduced_reduction, dtype, M, N, K, trans_a, trans_b, pad, beta):
    """The row-major helper on M != N != K, both transposes, strided operands and output:
    == torch.mm / addmm_ on the same views, nothing written outside the output view, and
    close to float64."""
    torch.manual_seed(M * 100 + N * 10 + K)
    a = _padded(K, M, pad, dtype) if trans_a else _padded(M, K, pad, dtype)
    b = _padded(N, K, pad + 2, dtype) if trans_b else _padded(K, N, pad + 2, dtype)
    big = randn(M, N + pad + 3, dtype=dtype)
    big_ref = big.clone()
    out, out_ref = big[:, :N], big_ref[:, :N]
    c0 = out.double()
    A, B = (a.t() if trans_a else a), (b.t() if trans_b else b)
    assert ext.lstm_gemm_rm(out, a, trans_a, b, trans_b, beta) is True, "the direct cuBLAS path did not run"
    if beta == 0.0:
        torch.mm(A, B, out=out_ref)
    else:
        out_ref.addmm_(A, B)
    assert_same(big[:, N:], big_ref[:, N:], True, "padding was written")
    assert_same(out, out_ref, exact=min(M, N, K) >= 2, name="vs torch.mm")
    want = A.double() @ B.double() + beta * c0
    err = (out.double() - want).abs().max().item()
    assert err <= 4 * SAME_INPUT_TOL[dtype][0] * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32])
def test_gemm_rm_fp32_and_deterministic_mode_use_aten(ext, dtype):
    """fp32 (TF32 policy is torch's) and deterministic mode keep the ATen call."""
    a, b, out = randn(6, 5, dtype=dtype), randn(5, 7, dtype=dtype), torch.empty(6, 7, device="cuda", dtype=dtype)
    assert ext.lstm_gemm_rm(out, a, False, b, False, 0.0) is False
    torch.testing.assert_close(out, a @ b)
    h = randn(6, 5, dtype=torch.bfloat16)
    hb, hout = randn(5, 7, dtype=torch.bfloat16), torch.empty(6, 7, device="cuda", dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert ext.lstm_gemm_rm(hout, h, False, hb, False, 0.0) is False
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(hout, h @ hb)


def _cell_with_torch_gemms(ext, x, h, c, w_ih, w_hh, b_ih, b_hh, dh, dc):
    """The cell's math with torch.mm / addmm_ for the GEMMs and our pointwise kernels."""
    gates = torch.mm(x, w_ih.t())
    gates.addmm_(h, w_hh.t())
    h1, c1, ws = ext.lstm_cell_pointwise_forward(gates, None, c, b_ih, b_hh)
    dg, dc0 = ext.lstm_cell_pointwise_backward(dh, None, dc, c, c1, ws)
    return [h1, c1, ws], [torch.mm(dg, w_ih), torch.mm(dg, w_hh), dc0, torch.mm(dg.t(), x), torch.mm(dg.t(), h)]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("B,I,H", [(7, 40, 24), (1, 16, 8), (33, 64, 128), (4, 24, 1023)])
def test_cell_direct_cublas_is_torch_gemms_bitwise(ext, reduced_reduction, dtype, B, I, H):
    exact = _cell_inputs(B, I, H, dtype)
    x, h, c, w_ih, w_hh, b_ih, b_hh = [t.to(dtype) for t in exact]
    dh, dc = randn(B, H, dtype=dtype), randn(B, H, dtype=dtype)
    fwd = ext.lstm_cell_forward(x, h, c, w_ih, w_hh, b_ih, b_hh)
    bwd = ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, fwd[2], fwd[1], [True] * 6)
    fwd_t, bwd_t = _cell_with_torch_gemms(ext, x, h, c, w_ih, w_hh, b_ih, b_hh, dh, dc)
    same = B >= 2  # see the section comment
    for name, got, want in zip(["h'", "c'", "ws", "dx", "dh", "dc", "dw_ih", "dw_hh"], fwd + bwd[:5], fwd_t + bwd_t):
        assert_same(got, want, same, name)
    # db is summed by the backward kernel (fp32, fixed order), not by torch's sum: checked
    # against float64 in test_cell_bias_grad_fused_sum; here only that it is the bias's.
    assert bwd[5].dtype == dtype and bwd[5].shape == (4 * H,)
    # Through the C++ autograd node: the same calls, so the same bits.
    leaves = [t.clone().requires_grad_() for t in (x, h, c, w_ih, w_hh, b_ih, b_hh)]
    out = lstm_ops.lstm_cell(*leaves, fused=True)
    grads = torch.autograd.grad(out, leaves, (dh, dc))
    for name, got, want in zip(["h'", "c'", "dx", "dh", "dc", "dw_ih", "dw_hh", "db_ih", "db_hh"],
                               list(out) + list(grads), fwd[:2] + bwd + bwd[-1:]):
        assert torch.equal(got, want), name
    # And the math: float64 autograd of the reference.
    f64 = [t.double().requires_grad_() for t in (x, h, c, w_ih, w_hh, b_ih, b_hh)]
    out_x = reference.lstm_cell(*f64)
    g_x = torch.autograd.grad(out_x, f64, (dh.double(), dc.double()))
    for name, got, want in zip(["h'", "c'", "dx", "dh", "dc", "dw_ih", "dw_hh", "db_ih"], list(out) + list(grads),
                               list(out_x) + list(g_x)):
        assert rel_err(got, want) < 2 * norm_tol(dtype), (name, rel_err(got, want))


def _layer_with_torch_gemms(ext, x, h0, c0, w_ih, w_hh, b_ih, b_hh, d_out, dc_n):
    """lstm_layer_forward/backward's loop with torch.mm / addmm_ GEMMs, our pointwise kernels."""
    T, B, I = x.shape
    H = h0.shape[1]
    xg = torch.mm(x.reshape(T * B, I), w_ih.t()).view(T, B, 4 * H)
    outs, cs, wss = [], [], []
    h, c = h0, c0
    for t in range(T):
        g = xg[t]
        g.addmm_(h, w_hh.t())
        h, c, ws = ext.lstm_cell_pointwise_forward(g, None, c, b_ih, b_hh)
        outs.append(h), cs.append(c), wss.append(ws)
    out, c_all, ws = torch.stack(outs), torch.stack(cs), torch.stack(wss)
    dg, dh_rec, dc = torch.empty_like(ws), None, dc_n
    for t in reversed(range(T)):
        dg[t], dc = ext.lstm_cell_pointwise_backward(d_out[t], dh_rec, dc, c0 if t == 0 else c_all[t - 1], c_all[t],
                                                     ws[t])
        dh_rec = torch.mm(dg[t], w_hh)
    dg2 = dg.view(T * B, 4 * H)
    dw_hh = torch.mm(dg[0].t(), h0)
    if T > 1:
        dw_hh.addmm_(dg[1:].reshape(-1, 4 * H).t(), out[:-1].reshape(-1, H))
    grads = [torch.mm(dg2, w_ih).view(T, B, I), dh_rec, dc, torch.mm(dg2.t(), x.reshape(T * B, I)), dw_hh,
             dg2.sum(0)]
    return [out, c_all, ws], grads


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("T,B,I,H", [(5, 3, 12, 16), (4, 1, 24, 8), (6, 7, 40, 64)])
def test_layer_direct_cublas_is_torch_gemms_bitwise(ext, reduced_reduction, dtype, T, B, I, H):
    exact = _cell_inputs(B, I, H, dtype, seed=T)
    _, h0, c0, w_ih, w_hh, b_ih, b_hh = [t.to(dtype) for t in exact]
    x = randn(T, B, I, dtype=dtype)
    d_out, dc_n = randn(T, B, H, dtype=dtype), randn(B, H, dtype=dtype)
    fwd = ext.lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    fwd = [t.clone() for t in fwd]  # the backward reads ws; keep the forward results apart
    bwd = ext.lstm_layer_backward(d_out, dc_n, x, h0, c0, fwd[0], fwd[1], fwd[2], w_ih, w_hh, [True] * 6)
    fwd_t, bwd_t = _layer_with_torch_gemms(ext, x, h0, c0, w_ih, w_hh, b_ih, b_hh, d_out, dc_n)
    same = B >= 2
    for name, got, want in zip(["out", "c_all", "ws", "dx", "dh0", "dc0", "dw_ih", "dw_hh", "db"], fwd + bwd,
                               fwd_t + bwd_t):
        assert_same(got, want, same, name)
    # The math, through the autograd Function, against float64.
    leaves = [t.clone().requires_grad_() for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh)]
    out_o, _, c_o = lstm_ops.lstm_layer(*leaves, fused=True)
    g_o = torch.autograd.grad((out_o, c_o), leaves, (d_out, dc_n))
    f64 = [t.double().requires_grad_() for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh)]
    out_x, _, c_x = lstm_ops.lstm_layer(*f64)
    g_x = torch.autograd.grad((out_x, c_x), f64, (d_out.double(), dc_n.double()))
    tol = 6 * norm_tol(dtype)
    for name, got, want in zip(["out", "c_n", "dx", "dh0", "dc0", "dw_ih", "dw_hh", "db_ih", "db_hh"],
                               [out_o, c_o, *g_o], [out_x, c_x, *g_x]):
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cell_gemms_skip_aten_only_for_16bit(ext, dtype):
    """The point of the direct cuBLAS GEMMs: a 16-bit cell fwd + bwd makes no aten::mm / addmm_ call
    (cuBLAS directly); fp32 still does (TF32 policy stays torch's)."""
    from torch.profiler import ProfilerActivity, profile

    x, h, c, w_ih, w_hh, b_ih, b_hh = [t.to(dtype).requires_grad_() for t in _cell_inputs(8, 16, 32, dtype)]
    lstm_ops.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh, fused=True)  # load / warm up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = lstm_ops.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh, fused=True)
        torch.autograd.grad(out, (x, h, c, w_ih, w_hh, b_ih, b_hh), [torch.ones_like(t) for t in out])
    names = {e.name for e in prof.events()}
    gemm_ops = names & {"aten::mm", "aten::addmm_", "aten::addmm", "aten::matmul"}
    assert "aten::sum" not in names  # the bias gradient is summed inside the backward kernel
    if dtype == torch.float32:
        assert gemm_ops, sorted(names)
    else:
        assert not gemm_ops, sorted(gemm_ops)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cell_and_layer_fwd_bwd_cuda_graph_direct_cublas(ext, dtype):
    """16-bit cell step (module fast path) and layer, fwd + autograd.grad captured in a
    CUDA graph: the direct cuBLAS calls land on the capture stream with torch's workspace,
    and replays on new inputs give the eager results."""
    torch.manual_seed(0)
    B, I, H, T = 6, 24, 32, 5
    cell = FusedLSTMCell(I, H, device="cuda", dtype=dtype, fused=True)
    params = list(cell.parameters())
    xhc = [randn(B, n, dtype=dtype).requires_grad_() for n in (I, H, H)]
    xs = randn(T, B, I, dtype=dtype).requires_grad_()
    cot = [randn(B, H, dtype=dtype) for _ in range(2)]
    cot_seq = randn(T, B, H, dtype=dtype)

    def step():
        out = cell(xhc[0], (xhc[1], xhc[2]))
        r = list(out) + list(torch.autograd.grad(out, xhc + params, cot))
        seq, _, c_n = lstm_ops.lstm_layer(xs, xhc[1], xhc[2], *params, fused=True)
        return r + [seq, c_n] + list(torch.autograd.grad((seq, c_n), [xs, xhc[1]] + params, (cot_seq, cot[1])))

    g, captured = capture_graph(step)
    with torch.no_grad():
        for t in xhc + [xs]:
            t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(captured, step())):
        rtol, atol = SAME_INPUT_TOL[dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"output {i}")


# ---------------------------------------------------------------- fused bias gradient
# The cell backward kernel sums db over the batch rows itself: fp32 gate gradients before
# rounding, per block in a fixed tree, then (several row chunks) the last block of each
# column strip adds the chunks' fp32 partials in chunk order (an atomic ticket finds it).

# Row counts around the kernel's chunking: a 16-bit vector launch has 64 row lanes and at
# most 16 chunks (B=1024: 16 chunks of 64 rows, B=2049: 11 chunks of 192 rows); the scalar
# path (odd H) has 8 lanes; fp32 vectors 32.
DB_SIZES = [(1, 1), (1, 1024), (2, 33), (63, 8), (64, 1024), (65, 24), (256, 1024), (257, 1023), (1000, 40),
            (1024, 1024), (2049, 64), (130, 1)]


def _db_inputs(B, H, dtype, seed):
    torch.manual_seed(seed)
    ig, c = randn(B, 4 * H, dtype=dtype, scale=2), randn(B, H, dtype=dtype)
    _, c1, ws = mptrain_ops.get_extension(required=True).lstm_cell_pointwise_forward(ig, None, c, None, None)
    return c, c1, ws, randn(B, H, dtype=dtype), randn(B, H, dtype=dtype)


def _db_reference_and_tol(c, c1, ws, dh, dc, dtype):
    """float64 db from the same (rounded) saved tensors, and a per-column bound: half an ulp
    of the storage dtype (the final rounding, subnormals included) + fp32 error (the
    kernel's gate math, a few ulps of the terms it combines; summation depth well below 64)."""
    d = [t.double() for t in (dh, dc, c, c1, ws)]
    dg, _ = reference.lstm_cell_pointwise_backward(d[0], None, d[1], d[2], d[3], d[4])
    want = dg.sum(0)
    scale = ((d[0].abs() + d[1].abs()) * (1 + d[2].abs())).sum(0).repeat(4)  # bounds |gate grad terms|
    u32 = 2.0**-24
    fi = torch.finfo(dtype)
    tol = 0.5 * fi.eps * (want.abs() + fi.smallest_normal) + u32 * (64 * dg.abs().sum(0) + 16 * scale)
    return want, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", DB_SIZES)
def test_cell_bias_grad_fused_sum(ext, dtype, B, H):
    """db from the cell backward vs float64, tight per column (a dropped or doubled row, a
    chunk or a strip summed wrong, or rounding the gate gradients before the sum at large B
    gives errors well above the bound); deterministic run to run; the same with db alone."""
    c, c1, ws, dh, dc = _db_inputs(B, H, dtype, seed=B * 31 + H)
    x, h = randn(B, 5, dtype=dtype), randn(B, H, dtype=dtype)
    w_ih, w_hh = randn(4 * H, 5, dtype=dtype), randn(4 * H, H, dtype=dtype)
    poison([4 * H, B * 4 * H], dtype)
    r = ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, [True] * 6)
    db = r[5]
    assert db.dtype == dtype and db.shape == (4 * H,) and torch.isfinite(db).all()
    want, tol = _db_reference_and_tol(c, c1, ws, dh, dc, dtype)
    err = (db.double() - want).abs()
    assert (err <= tol).all(), (err - tol).max().item()
    # the gate gradients (seen through dx = dg W_ih) and dc, written by the same launch
    dg64, dc64 = reference.lstm_cell_pointwise_backward(dh.double(), None, dc.double(), c.double(), c1.double(),
                                                        ws.double())
    assert rel_err(r[0], dg64 @ w_ih.double()) < 2 * norm_tol(dtype)
    rtol, atol = SAME_INPUT_TOL[dtype]
    torch.testing.assert_close(r[2].double(), dc64, rtol=rtol, atol=atol)
    for need in ([True] * 6, [False] * 5 + [True], [False, True, False, False, False, True]):
        again = ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)
        assert torch.equal(again[5], db), need


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,H", [(256, 1024), (1000, 40)])
def test_cell_bias_grad_fused_sum_scalar_path(ext, dtype, B, H):
    """A misaligned c (an offset view) sends the launch down the unvectorised path, which
    has 8 row lanes: more rows per lane and other chunk counts at the same sizes."""
    c, c1, ws, dh, dc = _db_inputs(B, H, dtype, seed=B + 7 * H)
    c_mis = randn(B * H + 1, dtype=dtype)[1:].view(B, H)
    c_mis.copy_(c)
    x, h = randn(B, 5, dtype=dtype), randn(B, H, dtype=dtype)
    w_ih, w_hh = randn(4 * H, 5, dtype=dtype), randn(4 * H, H, dtype=dtype)
    db = ext.lstm_cell_backward(dh, dc, x, h, c_mis, w_ih, w_hh, ws, c1, [False] * 5 + [True])[5]
    want, tol = _db_reference_and_tol(c, c1, ws, dh, dc, dtype)
    err = (db.double() - want).abs()
    assert (err <= tol).all(), (err - tol).max().item()


def test_cell_bias_grad_without_upstream_grads_and_empty_batch(ext):
    """dh and dc both absent (outputs unused): db is zero; B = 0: db is zero."""
    c, c1, ws, _, _ = _db_inputs(70, 16, torch.bfloat16, seed=3)
    x, w_ih, w_hh = randn(70, 5, dtype=torch.bfloat16), randn(64, 5, dtype=torch.bfloat16), randn(64, 16, dtype=torch.bfloat16)
    r = ext.lstm_cell_backward(None, None, x, c, c, w_ih, w_hh, ws, c1, [False] * 5 + [True])
    assert torch.equal(r[5], torch.zeros_like(r[5]))
    e = torch.empty(0, 16, device="cuda", dtype=torch.bfloat16)
    r = ext.lstm_cell_backward(None, None, e[:, :5], e, e, w_ih, w_hh, torch.empty(0, 64, device="cuda",
                                                                                  dtype=torch.bfloat16), e,
                               [False] * 5 + [True])
    assert r[5].shape == (64,) and (r[5] == 0).all()


@pytest.mark.parametrize("B,H", [(256, 1024), (1000, 40), (65, 1023)])
def test_cell_bias_grad_streams_and_cuda_graph_are_bitwise_eager(ext, B, H):
    """The tickets: per stream when eager (side stream, then default stream, alternating
    sizes so a strip's ticket is reused with other chunk counts), per launch inside a
    captured graph (own tickets + memset node). Same bits everywhere, on every replay."""
    dtype = torch.bfloat16
    c, c1, ws, dh, dc = _db_inputs(B, H, dtype, seed=B + H)
    x, h = randn(B, 5, dtype=dtype), randn(B, H, dtype=dtype)
    w_ih, w_hh = randn(4 * H, 5, dtype=dtype), randn(4 * H, H, dtype=dtype)
    need = [False] * 5 + [True]
    eager = ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)[5]
    small = _db_inputs(3, 8, dtype, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            on_side = ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)[5]
            ext.lstm_cell_backward(small[3], small[4], small[0], small[0], small[0], randn(32, 8, dtype=dtype),
                                   randn(32, 8, dtype=dtype), small[2], small[1], need)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, eager)
    g, captured = capture_graph(lambda: ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)[5])
    for _ in range(3):
        captured.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    # and the eager launch after the graph (its tickets untouched by the replays)
    assert torch.equal(ext.lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c1, need)[5], eager)


# ---------------------------------------------------------------- the hand-written autograd node
# csrc/lstm_autograd.cu's node replaced a torch::autograd::Function: the same contract is
# checked here on the real extension (CPU tensors take the node's ATen path, which allows
# float64 gradcheck; CUDA tensors its kernels). On torch < 2.14 the node is a shared_ptr
# with torch's deleteNode, on newer torch an intrusive_ptr: the long chain checks that.


def _cell(*tensors):
    """(h', c') of torch.ops.mptrain.lstm_cell: on CUDA tensors its C++ autograd node
    (csrc/lstm_autograd.cu), on the CPU the Python formula."""
    h, c, _ = torch.ops.mptrain.lstm_cell(*tensors)
    return h, c


def _node_inputs(device, dtype, bias=(True, True), B=3, I=4, H=5, seed=0):
    torch.manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    t = [r(B, I), r(B, H), r(B, H), r(4 * H, I) * 0.5, r(4 * H, H) * 0.5, r(4 * H), r(4 * H)]
    return t[:5] + [t[5] if bias[0] else None, t[6] if bias[1] else None]


@pytest.mark.parametrize("bias", [(True, True), (False, False), (True, False), (False, True)])
def test_op_gradcheck_cpu_path(bias):
    """The op's CPU kernel with its Python autograd formula (the CUDA node's twin)."""
    t = [None if v is None else v.requires_grad_() for v in _node_inputs("cpu", torch.float64, bias)]
    torch.autograd.gradcheck(lambda *a: _cell(*a), t)


@pytest.mark.parametrize("device", ["cuda"])  # the C++ node serves CUDA tensors
@pytest.mark.parametrize("bias", [(True, False), (False, True)])
def test_node_one_bias_gets_its_gradient(ext, device, bias):
    """With one bias absent, the present one's gradient sits at edge 5 either way."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    t = [None if v is None else v.requires_grad_() for v in _node_inputs(device, dtype, bias)]
    r = [None if v is None else v.detach().double().requires_grad_() for v in t]
    out, out_r = _cell(*t), reference.lstm_cell(*r)
    cot = [torch.randn_like(o) for o in out_r]
    leaves = [v for v in t if v is not None]
    g = torch.autograd.grad(out, leaves, [c.to(dtype) for c in cot])
    g_r = torch.autograd.grad(out_r, [v for v in r if v is not None], cot)
    for a, b in zip(g, g_r):
        assert rel_err(a, b) < 10 * norm_tol(torch.float32)


@pytest.mark.parametrize("device", ["cuda"])  # the C++ node serves CUDA tensors
def test_node_retain_graph_and_second_backward(ext, device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    t = [v.requires_grad_() for v in _node_inputs(device, dtype)]
    out = _cell(*t)
    assert out[0].grad_fn.name() == "LSTMCellBackward" and out[1].grad_fn is out[0].grad_fn
    cot = [torch.randn_like(o) for o in out]
    g1 = torch.autograd.grad(out, t, cot, retain_graph=True)
    g2 = torch.autograd.grad(out, t, cot)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, t, cot)


@pytest.mark.parametrize("device", ["cuda"])  # the C++ node serves CUDA tensors
@pytest.mark.parametrize("victim", ["x", "h", "c", "w_ih", "c_new"])
def test_node_in_place_change_of_a_saved_tensor_raises(ext, device, victim):
    dtype = torch.float64 if device == "cpu" else torch.float32
    t = _node_inputs(device, dtype)
    t[3].requires_grad_()
    k = {"x": 0, "h": 1, "c": 2}.get(victim)
    if k is not None:
        t[k] = t[k].clone().requires_grad_() * 1.0  # a non-leaf input that may be changed in place
    out = _cell(*t)
    target = out[1] if victim == "c_new" else t[3] if victim == "w_ih" else t[k]
    with torch.no_grad():
        target.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out[0].sum().backward()


@pytest.mark.parametrize("device", ["cuda"])  # the C++ node serves CUDA tensors
def test_node_grad_mode_off_saved_tensor_hooks_and_forward_ad(ext, device):
    import torch.autograd.forward_ad as fwAD

    dtype = torch.float64 if device == "cpu" else torch.float32
    t = [v.requires_grad_() for v in _node_inputs(device, dtype)]
    with torch.no_grad():
        h, c = _cell(*t)
    assert h.grad_fn is None and not h.requires_grad and not c.requires_grad
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: packed.append(1) or v, lambda v: v):
        out = _cell(*t)
    assert len(packed) == 7  # x, h, c, w_ih, w_hh, the activated gates, c'
    out[0].sum().backward()
    with fwAD.dual_level():
        x = fwAD.make_dual(t[0].detach(), torch.ones_like(t[0]))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            _cell(x, *t[1:])


def test_node_long_chain_is_freed_without_deep_recursion(ext):
    H = 2
    w = [torch.randn(4 * H, H, device="cuda", requires_grad=True) for _ in range(2)]
    h = c = torch.zeros(1, H, device="cuda", requires_grad=True)
    for _ in range(100_000):
        h, c = _cell(h, h, c, w[0], w[1], None, None)
    del h, c  # recursive destruction of 100k nodes would overflow the stack


def test_module_fast_path_reads_parameters_and_honours_parametrizations(ext):
    """FusedLSTMCell's step path takes its weights from _parameters; a parametrized
    weight is not there and must still be used as the attribute computes it."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    cell = FusedLSTMCell(6, 8, device="cuda", dtype=torch.bfloat16, fused=True)
    x, h, c = (randn(4, n, dtype=torch.bfloat16) for n in (6, 8, 8))
    plain = cell(x, (h, c))
    want = reference.lstm_cell(x, h, c, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    for o, w in zip(plain, want):
        assert rel_err(o, w) < norm_tol(torch.bfloat16)
    parametrize.register_parametrization(cell, "weight_hh", Double())
    doubled = cell(x, (h, c))
    want = reference.lstm_cell(x, h, c, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    for o, w in zip(doubled, want):
        assert rel_err(o, w) < norm_tol(torch.bfloat16)
    assert not torch.equal(doubled[0], plain[0])
    doubled[0].float().sum().backward()
    assert cell.parametrizations.weight_hh.original.grad is not None
