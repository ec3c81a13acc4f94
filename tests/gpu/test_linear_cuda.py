"""PaddedLinear on CUDA: which calls pad (16-bit GEMMs, autocast included; never fp32), the padded result
and gradients against nn.Linear's, torch.compile fullgraph (inductor) and CUDA-graph capture."""
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from mptrain.nn import PaddedLinear

N_IN, N_OUT = 256, 30522  # BERT's vocabulary: 30522 % 8 == 2


def _pair(dtype):
    torch.manual_seed(0)
    ref = nn.Linear(N_IN, N_OUT, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.bias.normal_()
    m = nn.Linear(N_IN, N_OUT, device="cuda", dtype=dtype)
    m.load_state_dict(ref.state_dict())
    return ref, PaddedLinear.from_module(m)


def _fwd_bwd(m, x, g, autocast=None):
    x = x.detach().requires_grad_()
    m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        y = m(x)
    y.backward(g)
    return [y, x.grad, m.weight.grad, m.bias.grad]


def _close(got, want, dtype):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        # the same dot products; a 16-bit output may round one ulp apart between cuBLAS kernels
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < (1e-2 if dtype != torch.float32 else 1e-5), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gemm_pads_and_matches_nn_linear(dtype):
    ref, m = _pair(dtype)
    x = torch.randn(64, 3, N_IN, device="cuda", dtype=dtype)
    g = torch.randn(64, 3, N_OUT, device="cuda", dtype=dtype)
    assert m.pads(x)
    got = _fwd_bwd(m, x, g)
    assert got[0].is_contiguous()
    _close(got, _fwd_bwd(ref, x, g), dtype)


def test_autocast_pads_and_matches_nn_linear():
    ref, m = _pair(torch.float32)
    x = torch.randn(64, N_IN, device="cuda")
    g = torch.randn(64, N_OUT, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert m.pads(x)
    got = _fwd_bwd(m, x, g, torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    _close(got, _fwd_bwd(ref, x, g, torch.bfloat16), torch.bfloat16)


def test_fp32_gemm_does_not_pad():
    ref, m = _pair(torch.float32)
    x = torch.randn(8, N_IN, device="cuda")
    assert not m.pads(x)
    assert torch.equal(m(x), ref(x))


@pytest.mark.parametrize("autocast", [False, True])
def test_compiles_fullgraph_with_inductor(autocast):
    ref, m = _pair(torch.float32 if autocast else torch.bfloat16)
    x = torch.randn(64, N_IN, device="cuda", dtype=torch.float32 if autocast else torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got, want = compiled(x), ref(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _close([got], [want], torch.bfloat16)
    got.float().sum().backward()
    assert m.weight.grad.shape == (N_OUT, N_IN)


def test_forward_and_backward_capture_in_a_cuda_graph():
    _, m = _pair(torch.bfloat16)
    x = torch.randn(32, N_IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(32, N_OUT, device="cuda", dtype=torch.bfloat16)

    def step():
        y = m(x)
        return [y, *torch.autograd.grad(y, (x, m.weight, m.bias), g)]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, step()):
        torch.testing.assert_close(a, e)
    want = F.linear(x, m.weight, m.bias)
    _close([captured[0]], [want], torch.bfloat16)
