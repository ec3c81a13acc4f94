"""Llama decoder LM LightningModule: transformers' LlamaForCausalLM built from a config (no download), the loss
computed inside the network's forward (what ``compile=True`` compiles), torch AdamW with warm-up and cosine decay,
next-token cross-entropy and perplexity."""
from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import MeanMetric

from mptrain.models.checks import check_args
from mptrain.models.optim import decay_groups
from mptrain.models.schedules import per_step, run_length, warmup_cosine
from mptrain.models.train_loss import log_train_loss


def build_llama(vocab_size: int, hidden_size: int = 2048, num_layers: int = 16, num_heads: int = 16,
                num_kv_heads: Optional[int] = None, intermediate_size: int = 8192,
                max_position_embeddings: int = 2048, attn_implementation: str = "sdpa"):
    """A randomly initialized ``LlamaForCausalLM`` (untied head, no KV cache: a model to train)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError("the Llama model needs transformers: pip install 'mptrain[nlp]'") from e
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config)


class CausalLMNet(nn.Module):
    """``LlamaForCausalLM``'s decoder and head (its own modules: the same state-dict keys), the whole network and
    the loss in one ``forward``: compiled, the fp32 upcast of the logits fuses into the cross-entropy instead of
    materializing an fp32 copy of a (tokens x vocabulary) tensor."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.model, self.lm_head = lm.model, lm.lm_head

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, use_cache=False)
        # the last hidden state, read as a dict's first value (ModelOutput's own item access is a method
        # some torch versions' dynamo cannot trace)
        return self.lm_head(next(iter(out.values())))

    def forward(self, input_ids: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits, or with ``targets`` (``input_ids`` shifted by one) the mean next-token loss."""
        logits = self.logits(input_ids)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def rope_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the rotary embeddings' buffers (``inv_freq``), by qualified name."""
    return {f"{name}.{b}": t.detach().clone() for name, m in module.named_modules()
            if type(m).__name__.endswith("RotaryEmbedding")
            for b, t in m.named_buffers(recurse=False) if t.dtype == torch.float32}


def restore_rope_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put back the fp32 rotary buffers ``saved`` by :func:`rope_buffers` wherever a cast changed their dtype.

    A half precision casts a module's floating buffers with its weights; RoPE's ``inv_freq`` in bf16 (8 bits of
    mantissa) turns position p's angle p * f into p * f * (1 +- 2^-9): radians off at p = 2048 for the fastest
    frequencies, a position signal that degrades along the sequence."""
    for qualified, value in saved.items():
        owner, _, name = qualified.rpartition(".")
        m = module.get_submodule(owner)
        current = getattr(m, name)
        if current.dtype != value.dtype:
            setattr(m, name, value.to(current.device))


class LlamaLM(L.LightningModule):
    """Args:
        vocab_size: vocabulary (the CLI fills it from ``data.vocab_size`` when left ``None``).
        hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size / max_position_embeddings: the
            network (``num_kv_heads`` ``None``: as many as ``num_heads``, no grouped-query attention); a 1.2B
            Llama by default (hidden 2048, 16 layers, FFN 8192, 16 heads).
        lr / weight_decay / betas / eps: torch's AdamW (its fused kernel on CUDA; no decay on norms).
        warmup_steps / min_lr_ratio: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the end.
        total_steps: steps of the schedule; ``None`` asks the trainer.
        attn_implementation: transformers' attention backend ("sdpa", "eager", ...).
    """

    def __init__(self, vocab_size: Optional[int] = None, hidden_size: int = 2048, num_layers: int = 16,
                 num_heads: int = 16, num_kv_heads: Optional[int] = None, intermediate_size: int = 8192,
                 max_position_embeddings: int = 2048, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, warmup_steps: int = 2000,
                 min_lr_ratio: float = 0.1, total_steps: Optional[int] = None, attn_implementation: str = "sdpa"):
        super().__init__()
        if vocab_size is None:
            raise ValueError("model.vocab_size is not set: give it, or let the CLI take it from data.vocab_size")
        check_args(vocab_size=(vocab_size, ">= 1"), hidden_size=(hidden_size, ">= 1"),
                   num_layers=(num_layers, ">= 1"), num_heads=(num_heads, ">= 1"),
                   num_kv_heads=(num_kv_heads, ">= 1"), intermediate_size=(intermediate_size, ">= 1"),
                   max_position_embeddings=(max_position_embeddings, ">= 1"), lr=(lr, "> 0"),
                   weight_decay=(weight_decay, ">= 0"), eps=(eps, "> 0"), warmup_steps=(warmup_steps, ">= 0"),
                   min_lr_ratio=(min_lr_ratio, ">= 0"), total_steps=(total_steps, ">= 1"))
        if hidden_size % num_heads:
            raise ValueError(f"model.hidden_size={hidden_size} must be a multiple of model.num_heads={num_heads}")
        if num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(f"model.num_heads={num_heads} must be a multiple of model.num_kv_heads={num_kv_heads}")
        if min_lr_ratio > 1:
            raise ValueError(f"model.min_lr_ratio={min_lr_ratio!r} is invalid: it must be in [0, 1]")
        self.save_hyperparameters()
        self.model = CausalLMNet(build_llama(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                                             intermediate_size, max_position_embeddings, attn_implementation))
        self.val_loss = MeanMetric()  # token-weighted over the epoch (and the ranks), for the perplexity
        self._rope_fp32 = rope_buffers(self)  # a plain dict: neither moved nor cast with the module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits of every position."""
        return self.model(input_ids)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return self.model(x, y)

    def training_step(self, batch, batch_idx):
        return log_train_loss(self, self._loss(batch))

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch).detach()
        self.log("val/loss", loss)
        self.val_loss.update(loss, weight=batch[1].numel())

    def on_validation_epoch_end(self):
        """Perplexity over every token of the epoch: exp of the mean loss (a mean of exps would overstate it)."""
        self.log("val/perplexity", torch.exp(self.val_loss.compute().clamp(max=50.0)))
        self.val_loss.reset()

    # The precision plugin casts the module when a stage sets it up, before these hooks run.
    def on_fit_start(self):
        restore_rope_buffers(self, self._rope_fp32)

    def on_validation_start(self):
        restore_rope_buffers(self, self._rope_fp32)

    def on_test_start(self):
        restore_rope_buffers(self, self._rope_fp32)

    def on_predict_start(self):
        restore_rope_buffers(self, self._rope_fp32)

    def configure_optimizers(self):
        hp = self.hparams
        cuda = next(self.parameters()).is_cuda
        opt = torch.optim.AdamW(decay_groups(self, hp.weight_decay), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                fused=cuda or None)
        sched = warmup_cosine(opt, hp.warmup_steps, run_length(self, hp.total_steps), hp.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": per_step(sched)}
