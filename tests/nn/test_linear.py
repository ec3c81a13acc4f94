"""PaddedLinear: nn.Linear's parameters, state_dict and results; the padded call computes the same product
(forced on here: the CPU never pads); fuse_modules swaps only large, ragged, exact nn.Linear layers."""
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from mptrain.nn import PaddedLinear, fuse_modules

RAGGED = 8193  # 8193 % 8 == 1; with 128 inputs: 1,048,704 weights >= PaddedLinear.MIN_WEIGHT_NUMEL


@pytest.fixture
def always_pad(monkeypatch):
    """Take the padded path on the CPU (on CUDA it is taken for 16-bit GEMMs: tests/gpu/test_linear_cuda.py)."""
    monkeypatch.setattr(PaddedLinear, "pads", lambda self, x: self.out_features % 8 != 0)


def _pair(n_in=128, n_out=RAGGED, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    ref = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        if bias:
            ref.bias.normal_()
    new = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    new.load_state_dict(ref.state_dict())
    return ref, PaddedLinear.from_module(new)


def _fwd_bwd(m, x, g):
    x = x.detach().requires_grad_()
    y = m(x)
    y.backward(g)
    return y, x.grad, m.weight.grad, None if m.bias is None else m.bias.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_call_is_nn_linear(always_pad, bias, dtype):
    ref, m = _pair(bias=bias, dtype=dtype)
    x = torch.randn(3, 5, 128, dtype=dtype)
    g = torch.randn(3, 5, RAGGED, dtype=dtype)
    got, want = _fwd_bwd(m, x, g), _fwd_bwd(ref, x, g)
    assert got[0].shape == want[0].shape and got[0].is_contiguous()
    assert m.weight.shape == (RAGGED, 128) and m.weight.grad.shape == (RAGGED, 128)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **tol)


def test_cpu_call_is_nn_linear_bitwise():
    ref, m = _pair(dtype=torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert not m.pads(x)
    assert torch.equal(m(x), ref(x))


def test_aligned_width_never_pads(always_pad):
    _, m = _pair(n_out=8192)
    assert not m.pads(torch.randn(2, 128))


def test_from_module_keeps_parameters_hooks_and_tying():
    emb = nn.Embedding(RAGGED, 128)
    head = nn.Linear(128, RAGGED)
    head.weight = emb.weight  # tied, as a language model's decoder
    seen = []
    head.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    keys, params = list(head.state_dict()), list(head.parameters())
    assert PaddedLinear.from_module(head) is head and type(head) is PaddedLinear
    assert head.weight is emb.weight and list(head.parameters()) == params and list(head.state_dict()) == keys
    head(torch.randn(2, 128))
    assert seen == [torch.Size([2, RAGGED])]
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv1d"):
        PaddedLinear.from_module(nn.Conv1d(2, 2, 1))


class _MyLinear(nn.Linear):
    """A user subclass: may override forward, so fuse_modules leaves it alone."""


def test_fuse_modules_swaps_large_ragged_linears_only():
    net = nn.ModuleDict({"vocab": nn.Linear(128, RAGGED), "aligned": nn.Linear(128, 8192),
                         "small": nn.Linear(8, 13), "ragged_in": nn.Linear(129, RAGGED),
                         "subclass": _MyLinear(128, RAGGED)})
    x = torch.randn(2, 128)
    before = net["vocab"](x)
    fuse_modules(net)
    assert type(net["vocab"]) is PaddedLinear
    assert {k: type(v) for k, v in net.items() if k != "vocab"} == {
        "aligned": nn.Linear, "small": nn.Linear, "ragged_in": nn.Linear, "subclass": _MyLinear}
    assert torch.equal(net["vocab"](x), before)


def test_bert_recipe_model_pads_its_vocabulary_projection():
    pytest.importorskip("transformers")
    from mptrain.models.bert import BertMLM

    m = BertMLM(vocab_size=30522, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128,
                max_position_embeddings=32)
    decoder = m.model.cls.predictions.decoder
    assert type(decoder) is PaddedLinear
    assert decoder.weight is m.model.bert.embeddings.word_embeddings.weight  # still tied
    stock = BertMLM(vocab_size=30522, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128,
                    max_position_embeddings=32, fused_layernorm=False)
    assert type(stock.model.cls.predictions.decoder) is nn.Linear


def test_padded_call_compiles_fullgraph(always_pad):
    ref, m = _pair(dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(x), ref(x), rtol=2e-2, atol=2e-2)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_padding_is_zero_rows_and_gets_no_gradient(always_pad, monkeypatch):
    """The weight the GEMM sees: the parameter's rows, then zeros up to a multiple of 64."""
    _, m = _pair(n_in=8, n_out=13)
    seen = {}
    real = F.linear

    def spy(x, w, b=None):
        seen["w"], seen["b"] = w, b
        return real(x, w, b)

    monkeypatch.setattr(F, "linear", spy)
    m(torch.randn(2, 8)).sum().backward()
    assert seen["w"].shape == (64, 8) and seen["b"].shape == (64,)
    assert torch.equal(seen["w"][:13], m.weight) and not seen["w"][13:].any() and not seen["b"][13:].any()
    assert m.weight.grad.shape == (13, 8) and m.bias.grad.shape == (13,)
