"""BERT masked-LM LightningModule: transformers' BertForMaskedLM built from a config (no download), fused
LayerNorms (mptrain.nn.fuse_modules), AdamW with linear warm-up/decay, masked-token accuracy and perplexity."""
from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import MeanMetric

from mptrain.models.checks import check_args
from mptrain.models.optim import build_optimizer
from mptrain.models.schedules import per_step, run_length, warmup_linear
from mptrain.models.train_loss import log_train_loss
from mptrain.nn import fuse_modules


def build_bert_mlm(vocab_size: int, hidden_size: int = 768, num_layers: int = 12, num_heads: int = 12,
                   intermediate_size: int = 3072, max_position_embeddings: int = 512, dropout: float = 0.1,
                   attn_implementation: str = "sdpa"):
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError as e:
        raise ImportError("the BERT model needs transformers: pip install 'mptrain[nlp]'") from e
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=num_heads, intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    if attn_implementation == "mptrain_fused_softmax":
        from mptrain.nn.attention import register_transformers_attention

        register_transformers_attention()
    config._attn_implementation = attn_implementation
    return BertForMaskedLM(config)


class MaskedLMNet(nn.Module):
    """BERT's encoder and masked-LM head (``BertForMaskedLM``'s own modules: same state-dict keys), the whole
    network in one ``forward`` (what ``compile=True`` compiles), computing the loss of the masked positions only.

    Only masked positions go through the vocabulary projection, the head's largest GEMM: gathered with a fixed size
    per sequence with ``max_predictions`` (static shapes, no host sync), else by boolean indexing (one host sync).
    """

    def __init__(self, mlm: nn.Module, max_predictions: Optional[int] = None):
        super().__init__()
        self.bert, self.cls = mlm.bert, mlm.cls
        self.max_predictions = max_predictions

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if attention_mask is not None:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
        # No padding: the encoder gets no mask.  BertModel.forward builds an all-true one when it
        # cannot look at the tensors (CUDA-graph capture; tracing in some transformers versions),
        # and a mask moves SDPA off its fused kernels (cuDNN / flash) onto the fp32 math path.
        out = self.bert.encoder(self.bert.embeddings(input_ids=input_ids))
        # ``out[0]`` (its first value, the last hidden state), read as a dict's: ModelOutput's own item and
        # attribute access call a method torch 2.6's dynamo cannot trace (fullgraph would fail).
        return next(iter(out.values()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        hidden = self.encode(input_ids, attention_mask)
        picked = labels != -100
        k = self.max_predictions
        if k is None:
            h, target = hidden[picked], labels[picked]
        else:
            k = min(k, labels.shape[1])
            idx = picked.to(hidden.dtype).topk(k, dim=1).indices  # masked positions first
            h = hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])).flatten(0, 1)
            target = labels.gather(1, idx).flatten()
        logits = self.cls(h)
        count = (target != -100).sum()
        loss_sum = F.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")
        return loss_sum, logits, target, count


class BertMLM(L.LightningModule):
    """Args:
        vocab_size: vocabulary (the CLI fills it from ``data.vocab_size`` when left ``None``).
        hidden_size / num_layers / num_heads / intermediate_size / max_position_embeddings / dropout:
            BERT-base by default.
        lr / weight_decay / betas / eps: AdamW (no decay on biases and LayerNorms).
        warmup_steps: linear warm-up, then linear decay to 0 at the end of the run.
        total_steps: steps of the schedule; ``None`` asks the trainer.
        fused_layernorm: mptrain.nn's drop-ins (``fuse_modules``): fused LayerNorms, and the vocabulary
            projection as a PaddedLinear when the vocabulary is not a multiple of 8 (30522: its 16-bit GEMMs
            at a 64-aligned width).
        use_attention_mask: pass the batch's attention mask (only needed with padding: our blocks
            are never padded, and an all-ones mask keeps SDPA off its fastest kernels).
        max_predictions: masked tokens predicted per sequence (BERT's max_predictions_per_seq):
            a fixed-size gather without a host sync; a sequence with more masked tokens loses the
            extra ones from the loss. ``None``: all of them, by boolean indexing (syncs).
    """

    def __init__(self, vocab_size: Optional[int] = None, hidden_size: int = 768, num_layers: int = 12,
                 num_heads: int = 12, intermediate_size: int = 3072, max_position_embeddings: int = 512,
                 dropout: float = 0.1, lr: float = 1e-4, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, warmup_steps: int = 10_000,
                 total_steps: Optional[int] = None, fused_layernorm: bool = True, use_attention_mask: bool = False,
                 max_predictions: Optional[int] = None, attn_implementation: str = "sdpa"):
        super().__init__()
        if vocab_size is None:
            raise ValueError("model.vocab_size is not set: give it, or let the CLI take it from data.vocab_size")
        check_args(vocab_size=(vocab_size, ">= 1"), hidden_size=(hidden_size, ">= 1"),
                   num_layers=(num_layers, ">= 1"), num_heads=(num_heads, ">= 1"),
                   intermediate_size=(intermediate_size, ">= 1"), dropout=(dropout, "in [0, 1)"), lr=(lr, "> 0"),
                   weight_decay=(weight_decay, ">= 0"), eps=(eps, "> 0"), warmup_steps=(warmup_steps, ">= 0"),
                   total_steps=(total_steps, ">= 1"), max_predictions=(max_predictions, ">= 1"))
        self.save_hyperparameters()
        self.model = MaskedLMNet(build_bert_mlm(vocab_size, hidden_size, num_layers, num_heads, intermediate_size,
                                                max_position_embeddings, dropout, attn_implementation), max_predictions)
        if fused_layernorm:
            self.model = fuse_modules(self.model)
        self.val_loss = MeanMetric()  # token-weighted over the epoch (and the ranks), for the perplexity

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed loss over predicted tokens, their logits, their labels (-100: padding), count)."""
        mask = batch.get("attention_mask") if self.hparams.use_attention_mask else None
        return self.model(batch["input_ids"], batch["labels"], mask)

    def numerics_input(self, batch: dict) -> tuple:
        """``mptrain numerics`` passes the whole batch to ``forward`` (its labels pick the predicted positions)."""
        return (batch,)

    def training_step(self, batch, batch_idx):
        loss_sum, _, _, count = self(batch)
        return log_train_loss(self, loss_sum / count.clamp_min(1))

    def validation_step(self, batch, batch_idx):
        loss_sum, logits, target, count = self(batch)
        n = count.clamp_min(1).float()
        correct = ((logits.argmax(-1) == target) & (target != -100)).sum().float()
        self.log_dict({"val/loss": loss_sum.detach() / n, "val/mlm_acc": correct / n})
        self.val_loss.update(loss_sum.detach().float() / n, weight=n)

    def on_validation_epoch_end(self):
        """Perplexity over every masked token of the epoch: exp of the mean loss (a mean of exps would overstate it)."""
        self.log("val/perplexity", torch.exp(self.val_loss.compute().clamp(max=50.0)))
        self.val_loss.reset()

    def configure_optimizers(self):
        hp = self.hparams
        opt = build_optimizer("adamw", self, hp.weight_decay, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        sched = warmup_linear(opt, hp.warmup_steps, run_length(self, hp.total_steps))
        return {"optimizer": opt, "lr_scheduler": per_step(sched)}

