"""LSTM language model LightningModule on mptrain.nn.FusedLSTM: embedding, stacked LSTM,
dropout, tied output projection; next-token cross-entropy and perplexity."""
from __future__ import annotations

from typing import Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import MeanMetric

from mptrain.models.checks import check_args
from mptrain.models.optim import build_optimizer
from mptrain.models.schedules import per_step, run_length, warmup_cosine
from mptrain.models.train_loss import log_train_loss
from mptrain.nn import FusedLSTM


class LSTMNet(nn.Module):
    def __init__(self, vocab_size: int, embedding_dim: int, hidden_size: int, num_layers: int, dropout: float,
                 tie_weights: bool, fused: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_dim)
        self.drop = nn.Dropout(dropout)
        self.rnn = (FusedLSTM if fused else nn.LSTM)(embedding_dim, hidden_size, num_layers=num_layers,
                                                     batch_first=True, dropout=dropout if num_layers > 1 else 0.0)
        self.proj = nn.Linear(hidden_size, embedding_dim) if tie_weights and hidden_size != embedding_dim else None
        self.head = nn.Linear(embedding_dim if tie_weights else hidden_size, vocab_size)
        if tie_weights:
            self.head.weight = self.embed.weight  # halves the parameters and regularizes (Press & Wolf 2017)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.rnn(self.drop(self.embed(tokens)))[0])
        if self.proj is not None:
            h = self.proj(h)
        return self.head(h)


class LSTMLanguageModel(L.LightningModule):
    """Args:
        vocab_size: vocabulary (the CLI fills it from ``data.vocab_size`` when left ``None``).
        embedding_dim / hidden_size / num_layers / dropout / tie_weights: the network.
        fused: ``mptrain.nn.FusedLSTM`` (batch-first, nn.LSTM's interface) rather than ``torch.nn.LSTM``.
        optimizer / lr / weight_decay / warmup_steps / total_steps: AdamW or SGD, warm-up + cosine.
    """

    def __init__(self, vocab_size: Optional[int] = None, embedding_dim: int = 650, hidden_size: int = 650,
                 num_layers: int = 2, dropout: float = 0.5, tie_weights: bool = True, fused: bool = True,
                 optimizer: Literal["adamw", "sgd"] = "adamw", lr: float = 2e-3, weight_decay: float = 0.01,
                 warmup_steps: int = 100, total_steps: Optional[int] = None):
        super().__init__()
        if vocab_size is None:
            raise ValueError("model.vocab_size is not set: give it, or let the CLI take it from data.vocab_size")
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"model.optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        check_args(vocab_size=(vocab_size, ">= 1"), embedding_dim=(embedding_dim, ">= 1"),
                   hidden_size=(hidden_size, ">= 1"), num_layers=(num_layers, ">= 1"),
                   dropout=(dropout, "in [0, 1)"), lr=(lr, "> 0"), weight_decay=(weight_decay, ">= 0"),
                   warmup_steps=(warmup_steps, ">= 0"), total_steps=(total_steps, ">= 1"))
        self.save_hyperparameters()
        self.model = LSTMNet(vocab_size, embedding_dim, hidden_size, num_layers, dropout, tie_weights, fused)
        self.val_loss = MeanMetric()  # token-weighted over the epoch (and the ranks), for the perplexity

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

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

    def configure_optimizers(self):
        hp = self.hparams
        kwargs = {"momentum": 0.9} if hp.optimizer == "sgd" else {}
        opt = build_optimizer(hp.optimizer, self, hp.weight_decay, lr=hp.lr, **kwargs)
        sched = warmup_cosine(opt, hp.warmup_steps, run_length(self, hp.total_steps))
        return {"optimizer": opt, "lr_scheduler": per_step(sched)}
