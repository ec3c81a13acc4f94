"""No materialized mask where transformers' eager rule needs none: the rule, the context, a compiled model."""
from __future__ import annotations

import pytest
import torch

from mptrain.nn import sdpa_masks as M

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")


@pytest.mark.parametrize("kwargs,want", [
    (dict(q_length=16, kv_length=16), True),
    (dict(q_length=1, kv_length=16), True),
    (dict(q_length=8, kv_length=16), False),  # queries after a cache: a causal mask with an offset is needed
    (dict(q_length=16, kv_length=16, attention_mask=torch.ones(2, 16, dtype=torch.bool)), False),  # never read
    (dict(q_length=16, kv_length=16, allow_is_causal_skip=False), False),  # packed sequences, overlays
    (dict(q_length=16, kv_length=16, local_size=8), False),  # a sliding window reaching the keys
    (dict(q_length=16, kv_length=16, local_size=32), True),
    (dict(kv_length=16, allow_is_bidirectional_skip=True, allow_is_causal_skip=False), True),
    (dict(cache_position=torch.arange(16), kv_length=16), True),  # older transformers' spelling
    (dict(q_length=16), False),
])
def test_the_rule(kwargs, want):
    assert M.trivial(kwargs) is want


def test_the_context_swaps_transformers_sdpa_mask_and_puts_it_back():
    interface = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    before = interface["sdpa"]
    with M.skip_trivial_masks():
        inside = interface["sdpa"]
        assert inside is not before and inside.__wrapped__ is before
        with M.skip_trivial_masks():  # a nested forward adds nothing
            assert interface["sdpa"] is inside
        assert inside(batch_size=2, q_length=4, kv_length=4, attention_mask=None) is None
        padded = torch.tensor([[True, True, True, False], [True, True, True, True]])
        got = inside(batch_size=2, q_length=4, kv_length=4, attention_mask=padded)
        want = before(batch_size=2, q_length=4, kv_length=4, attention_mask=padded)
        assert got is not None and torch.equal(got, want)
    assert interface["sdpa"] is before
    with M.skip_trivial_masks():  # the same wrapper object each time: a compiled graph's guard holds
        assert interface["sdpa"] is inside


def test_a_users_own_local_override_survives():
    interface = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    original = interface["sdpa"]

    def users(**kw):
        return original(**kw)

    interface["sdpa"] = users
    try:
        with M.skip_trivial_masks():
            assert interface["sdpa"].__wrapped__ is users
        assert interface["sdpa"] is users
    finally:
        del interface["sdpa"]
    assert interface["sdpa"] is original


def _sdpa_calls(model, ids, compiled):
    """(mask shape or None, is_causal) of each SDPA call, eagerly (a spy) or in the compiled graph."""
    calls = []
    if not compiled:
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            out = model(input_ids=ids).logits
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
        return calls, out

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                calls.append((None if mask is None else tuple(mask.meta["example_value"].shape),
                              bool(n.kwargs.get("is_causal", False))))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(input_ids=ids).logits
    return calls, out


def _models():
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM
    small = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    return {"bert": (BertForMaskedLM(BertConfig(attn_implementation="sdpa", **small)), False),
            "llama": (LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", num_key_value_heads=2,
                                                   vocab_size=500, **small)), True)}


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_compiled_user_models_get_no_mask_and_the_same_output(name):
    torch.manual_seed(0)
    model, causal = _models()[name]
    model.eval()
    ids = torch.randint(0, 500, (2, 12))
    eager_calls, eager_out = _sdpa_calls(model, ids, compiled=False)
    assert eager_calls == [(None, causal)]  # transformers' own eager decision
    with M.skip_trivial_masks():
        calls, out = _sdpa_calls(model, ids, compiled=True)
        assert calls == [(None, causal)]  # the same decision compiled
        padded = torch.ones(2, 12, dtype=torch.long)
        padded[0, -3:] = 0
        torch._dynamo.reset()
        masked = model(input_ids=ids, attention_mask=padded).logits  # padding: transformers' mask, unchanged
    torch.testing.assert_close(out, eager_out)
    assert not torch.allclose(masked[0], eager_out[0])
