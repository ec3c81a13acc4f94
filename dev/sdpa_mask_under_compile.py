"""What a transformers model hands ``scaled_dot_product_attention`` eagerly and under ``torch.compile``: a mask
tensor or ``is_causal`` (lab tool, not shipped; runs on the CPU).

    python3 dev/sdpa_mask_under_compile.py            # as transformers makes the masks
    python3 dev/sdpa_mask_under_compile.py --mptrain  # inside mptrain.nn.sdpa_masks.skip_trivial_masks()

A mask tensor rules out the flash back end and costs the others a read of the mask; a model without padding
needs none.  Prints, per model and mode, each SDPA call's mask (shape, dtype) and is_causal.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _record(calls):
    def inspect_graph(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                meta = getattr(mask, "meta", {}).get("example_value") if mask is not None else None
                calls.append(("compiled", None if mask is None else tuple(getattr(meta, "shape", ())),
                              n.kwargs.get("is_causal")))
        return gm.forward
    return inspect_graph


def models():
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM
    yield "bert", BertForMaskedLM(BertConfig(attn_implementation="sdpa", num_hidden_layers=1, hidden_size=64,
                                             num_attention_heads=2, intermediate_size=128)), 30522
    yield "llama", LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", num_hidden_layers=1, hidden_size=64,
                                                num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                                                vocab_size=1000)), 1000


def skip_context():
    """mptrain.nn.sdpa_masks loaded from its file (it imports nothing of mptrain), so that this runs in a venv
    with only torch and transformers."""
    path = Path(__file__).resolve().parents[1] / "mptrain" / "nn" / "sdpa_masks.py"
    spec = importlib.util.spec_from_file_location("sdpa_masks", path)
    mod = sys.modules["sdpa_masks"] = importlib.util.module_from_spec(spec)  # dynamo looks the module up
    spec.loader.exec_module(mod)
    return mod.skip_trivial_masks()


def main():
    import transformers
    ours = "--mptrain" in sys.argv
    print("torch", torch.__version__, "transformers", transformers.__version__, "(mptrain's masks)" if ours else "")
    for name, model, vocab in models():
        ids = torch.randint(0, vocab, (2, 16))
        eager = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            eager.append(("eager", None if attn_mask is None else tuple(attn_mask.shape), is_causal))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        F.scaled_dot_product_attention = spy
        try:
            with skip_context() if ours else contextlib.nullcontext():
                model(input_ids=ids)
        finally:
            F.scaled_dot_product_attention = real
        compiled = []
        torch._dynamo.reset()
        with skip_context() if ours else contextlib.nullcontext():
            torch.compile(model, backend=_record(compiled))(input_ids=ids)
        for mode, mask, causal in eager + compiled:
            print(f"{name:6s} {mode:9s} attn_mask={mask} is_causal={causal}")


if __name__ == "__main__":
    main()
