"""Small models and data shared by the CPU tests."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


def classification_data(n: int = 256, d: int = 16, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    y = (x @ w).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def image_data(n: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class Classifier(L.LightningModule):
    """Trains ``net`` with cross-entropy; optional hooks to poison the loss at chosen steps."""

    def __init__(self, net: nn.Module, lr: float = 1e-2, optimizer: str = "adamw", inf_at_steps=(), inf_at_batches=()):
        super().__init__()
        self.net = net
        self.lr = lr
        self.optimizer_name = optimizer
        self.inf_at_steps = set(inf_at_steps)
        self.inf_at_batches = set(inf_at_batches)
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.detach().float())  # a tensor: no host sync per step
        step = self.trainer.global_step
        if step in self.inf_at_steps or (step, batch_idx) in self.inf_at_batches:
            loss = loss * float("inf")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.float(), y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x).float(), y))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def mlp(d: int = 16, classes: int = 4, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, classes))


def cnn(classes: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


class CausalLM(L.LightningModule):
    """A transformers ``LlamaForCausalLM`` (built from ``config``, seed 0) as a user trains it: the model's own loss,
    torch's AdamW; each step's loss kept in ``losses``."""

    def __init__(self, config, lr: float = 1e-3):
        import transformers

        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)
        self.lr, self.losses = lr, []

    def training_step(self, batch, _):
        loss = self.model(batch, labels=batch).loss
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def quiet_trainer(**kw):
    from mptrain import Trainer

    kw.setdefault("logger", False)
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return Trainer(**kw)
