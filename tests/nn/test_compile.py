"""torch.compile(fullgraph=True) of every mptrain.nn module and of the BERT recipe model
(fused LayerNorm and softmax): zero graph breaks, the custom ops in the graph, results
and gradients equal to eager (CPU, aot_eager for speed; one inductor case)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mptrain.nn import FusedLayerNorm, FusedLSTM, FusedLSTMCell, FusedRMSNorm, FusedScaleMaskSoftmax


class _Recorder:
    """A dynamo backend that keeps each FX graph's code, then runs aot_eager."""

    def __init__(self, backend="aot_eager"):
        self.codes, self.backend = [], backend

    def __call__(self, gm, example_inputs):
        self.codes.append(gm.code)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.backend)(gm, example_inputs)


def _check_compiles(module, inputs, op_name, backend="aot_eager"):
    """Compile ``module`` fullgraph, compare forward and backward with eager, and check the
    graph calls torch.ops.mptrain.<op_name> with no graph break."""
    torch._dynamo.reset()
    counters.clear()
    rec = _Recorder(backend)
    compiled = torch.compile(module, fullgraph=True, backend=rec)
    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in inputs]
    out_c, out_e = compiled(*inputs), module(*eager_in)
    flat_c, flat_e = torch.utils._pytree.tree_leaves(out_c), torch.utils._pytree.tree_leaves(out_e)
    for a, b in zip(flat_c, flat_e):
        torch.testing.assert_close(a, b)
    sum(o.float().sum() for o in flat_c).backward()
    sum(o.float().sum() for o in flat_e).backward()
    for a, b in zip([t for t in inputs if torch.is_tensor(t) and t.requires_grad],
                    [t for t in eager_in if torch.is_tensor(t) and t.requires_grad]):
        torch.testing.assert_close(a.grad, b.grad)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(rec.codes) == 1 and f"mptrain.{op_name}" in rec.codes[0], rec.codes
    return compiled


def _x(*shape, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_norm_compiles_fullgraph(dtype):
    m = FusedLayerNorm(16, dtype=dtype)
    _check_compiles(m, [_x(4, 16, dtype=dtype)], "layer_norm")
    for p in m.parameters():
        assert p.grad is not None


def test_fused_rms_norm_compiles_fullgraph():
    _check_compiles(FusedRMSNorm((3, 8)), [_x(2, 5, 3, 8)], "layer_norm")


@pytest.mark.parametrize("causal", [False, True])
def test_fused_softmax_compiles_fullgraph(causal):
    mask = torch.rand(2, 1, 1, 6) < 0.3
    _check_compiles(FusedScaleMaskSoftmax(0.5, causal), [_x(2, 3, 6, 6), mask], "scaled_masked_softmax")


def test_fused_lstm_cell_compiles_fullgraph():
    cell = FusedLSTMCell(5, 4)
    _check_compiles(cell, [_x(3, 5), (_x(3, 4), _x(3, 4))], "lstm_cell")


def test_fused_lstm_compiles_fullgraph():
    # Dynamo refuses every nn.LSTM instance (subclasses included) unless allow_rnn is set;
    # with it, impl="fused" traces to the lstm_layer op, one per layer.
    lstm = FusedLSTM(5, 4, num_layers=2, impl="fused")
    with torch._dynamo.config.patch(allow_rnn=True):
        _check_compiles(lstm, [_x(6, 3, 5)], "lstm_layer")


def test_fused_layer_norm_compiles_with_inductor():
    m = FusedLayerNorm(32)
    _check_compiles(m, [_x(8, 32)], "layer_norm", backend="inductor")


def test_compiled_step_loop_has_no_graph_break():
    """A step loop over FusedLSTMCell (the LSTM LM's pattern) traces as one graph."""
    cell = FusedLSTMCell(4, 4)

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, xs, h, c):
            for t in range(xs.shape[0]):
                h, c = self.cell(xs[t], (h, c))
            return h, c

    _check_compiles(Loop(), [_x(3, 2, 4), _x(2, 4), _x(2, 4)], "lstm_cell")


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.7",
                    reason="torch 2.6's dynamo cannot trace transformers' BertModel.forward: its decorator "
                           "merge_with_config_defaults reads func.__code__.co_varnames, and ModelOutput's "
                           "__getitem__ calls _replace_old_cache_name (custom dict: call_method unimplemented)")
def test_bert_encoder_with_fused_layer_norm_and_softmax_compiles_fullgraph():
    pytest.importorskip("transformers")
    from mptrain.models.bert import build_bert_mlm
    from mptrain.nn import fuse_modules
    from mptrain.nn.attention import register_transformers_attention

    torch.manual_seed(0)
    model = build_bert_mlm(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                           max_position_embeddings=16, dropout=0.0,
                           attn_implementation=register_transformers_attention())
    model = fuse_modules(model)
    assert any(isinstance(m, FusedLayerNorm) for m in model.modules())

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = model.bert

        def forward(self, ids):
            return self.bert(input_ids=ids)[0]

    ids = torch.randint(0, 50, (2, 8))
    torch._dynamo.reset()
    counters.clear()
    rec = _Recorder()
    enc = Encoder()
    out = torch.compile(enc, fullgraph=True, backend=rec)(ids)
    torch.testing.assert_close(out, enc(ids))
    out.sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(rec.codes) == 1
    assert "mptrain.layer_norm" in rec.codes[0] and "mptrain.scaled_masked_softmax" in rec.codes[0]
