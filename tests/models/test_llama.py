"""The Llama decoder LM (mptrain.models.LlamaLM) and its recipe: the loss is transformers' causal-LM loss, the
recipe trains a tiny variant on the CPU in 32-true and bf16-master, RoPE stays fp32 under a half precision, the
default model is a 1.2B Llama whose fp8-master plan runs every block linear in fp8, and fp8-master is refused on
the CPU."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mptrain import Trainer  # noqa: E402
from mptrain.cli import main  # noqa: E402
from mptrain.data import LMTextDataModule  # noqa: E402
from mptrain.models import LlamaLM  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "llama_1b.yaml")
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
TINY_ARGS = ["--model.hidden_size=64", "--model.num_layers=2", "--model.num_heads=4", "--model.intermediate_size=128",
             "--data.vocab_size=512", "--data.seq_len=32", "--data.synthetic=true", "--data.batch_size=2",
             "--trainer.compile=false", "--trainer.accelerator=cpu", "--trainer.max_steps=3",
             "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
             "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
             "--trainer.checkpoint_every_n_steps=null", "--model.warmup_steps=1"]


def result_line(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{") and '"subcommand"' in ln]
    assert lines, out[-2000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_the_recipe_trains_a_tiny_llama_for_three_steps_on_the_cpu(precision, capsys):
    rc = main(["fit", "--config", RECIPE, *TINY_ARGS, f"--trainer.precision={precision}"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    result = result_line(out)
    assert result["global_step"] == 3
    # random tokens: the loss starts at ln(vocabulary) and cannot go far below it in three steps
    assert abs(result["metrics"]["train/loss"] - math.log(512)) < 0.5, result
    assert math.isfinite(result["metrics"]["val/perplexity"])


def test_fp8_master_is_one_flag_away_and_refused_on_the_cpu(capsys):
    try:
        rc = main(["fit", "--config", RECIPE, *TINY_ARGS, "--trainer.precision=fp8-master"])
        message = capsys.readouterr().err
    except RuntimeError as e:  # raised at setup (the CLI leaves runtime errors to Python's report)
        rc, message = 1, str(e)
    assert rc != 0
    assert "fp8" in message and "compute capability" in message and "'cpu'" in message, message


def test_the_loss_is_transformers_causal_lm_loss_and_the_keys_are_its_keys():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    module = LlamaLM(**TINY).eval()
    reference = LlamaForCausalLM(module.model.model.config).eval()
    state = {k.removeprefix("model."): v for k, v in module.state_dict().items()}
    assert set(state) == set(reference.state_dict())
    reference.load_state_dict(state)
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        theirs = reference(input_ids=ids, labels=ids).loss  # shifts the labels itself
        ours = module.training_step((ids[:, :-1], ids[:, 1:]), 0)
        logits = module(ids[:, :-1])
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert logits.shape == (2, 16, 512)
    # causal: the logits of a prefix do not depend on the tokens after it
    with torch.no_grad():
        assert torch.allclose(module(ids[:, :8]), logits[:, :8], atol=1e-5)


def test_bf16_master_keeps_rope_and_norms_in_fp32():
    torch.manual_seed(0)
    module = LlamaLM(**TINY, warmup_steps=1)
    rope = module.model.model.rotary_emb
    before = rope.inv_freq.clone()
    dm = LMTextDataModule(synthetic=True, vocab_size=512, seq_len=32, batch_size=2, synthetic_batches=2)
    trainer = Trainer(precision="bf16-master", accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, before)
    assert rope.original_inv_freq.dtype == torch.float32
    layer = module.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert module.model.lm_head.weight.dtype == torch.bfloat16


def test_optimizer_is_torch_adamw_without_decay_on_norms_and_cosine_to_min_lr():
    module = LlamaLM(**TINY, lr=1e-3, weight_decay=0.1, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.9, 0.95)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # the end of the run: min_lr_ratio * lr


def test_the_default_model_is_a_1b_llama_with_every_block_linear_in_fp8():
    from mptrain.precision.fp8_policy import plan_fp8_layers, resolve_keep_list

    with torch.device("meta"):
        module = LlamaLM(vocab_size=32000)
    assert 1.20e9 < sum(p.numel() for p in module.parameters()) < 1.21e9
    convert, kept = plan_fp8_layers(module, resolve_keep_list("default"))
    assert len(convert) == 16 * 7 and list(kept) == ["model.lm_head"]


@pytest.mark.parametrize("bad, match", [
    (dict(vocab_size=None), "vocab_size is not set"),
    (dict(num_kv_heads=3), "multiple of model.num_kv_heads=3"),
    (dict(hidden_size=66), "hidden_size=66 must be a multiple of model.num_heads=4"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_bad_arguments_fail_when_the_model_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        LlamaLM(**{**TINY, **bad})
