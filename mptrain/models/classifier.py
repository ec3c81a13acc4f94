"""Image classifier LightningModule: cross-entropy with label smoothing, SGD (momentum) or AdamW
with warm-up + cosine, torchmetrics top-1/top-5 accuracy on validation."""
from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import multiclass_accuracy

from mptrain.models.checks import check_args
from mptrain.models.optim import build_optimizer
from mptrain.models.schedules import per_step, run_length, warmup_cosine
from mptrain.models.vision import build_image_model
from mptrain.models.train_loss import log_train_loss


class ImageClassifier(L.LightningModule):
    """Args:
        arch: ``digits_cnn`` or a torchvision model name (``resnet50``).
        num_classes: output classes.
        optimizer: "sgd" (momentum, optional Nesterov) or "adamw".
        lr / momentum / nesterov / weight_decay: optimizer settings (no decay on biases and norms).
        label_smoothing: cross-entropy label smoothing.
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        total_steps: steps of the schedule; ``None`` asks the trainer (``estimated_stepping_batches``).
        fused: mptrain's fused drop-ins where they apply (the max-pool kernel, the fp16 stem padding; same
            parameters and results); False: the network exactly as torchvision builds it.
    """

    def __init__(self, arch: str = "digits_cnn", num_classes: int = 10, optimizer: Literal["sgd", "adamw"] = "sgd",
                 lr: float = 0.1, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 1e-4,
                 label_smoothing: float = 0.0, warmup_steps: int = 0, min_lr_ratio: float = 0.0,
                 total_steps: int | None = None, fused: bool = True):
        super().__init__()
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"model.optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        check_args(num_classes=(num_classes, ">= 1"), lr=(lr, "> 0"), momentum=(momentum, ">= 0"),
                   weight_decay=(weight_decay, ">= 0"), label_smoothing=(label_smoothing, "in [0, 1)"),
                   warmup_steps=(warmup_steps, ">= 0"), min_lr_ratio=(min_lr_ratio, ">= 0"),
                   total_steps=(total_steps, ">= 1"))
        self.save_hyperparameters()
        self.model = build_image_model(arch, num_classes, fused=fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing), logits, y

    def training_step(self, batch, batch_idx):
        return log_train_loss(self, self._loss(batch)[0])

    def validation_step(self, batch, batch_idx):
        # Per-batch values: both Lightning and mptrain average them over the epoch (and ranks).
        loss, logits, y = self._loss(batch)
        logits, k = logits.float(), self.hparams.num_classes
        self.log_dict({
            "val/loss": loss.detach(),
            "val/acc": multiclass_accuracy(logits, y, k, top_k=1, average="micro"),
            "val/acc_top5": multiclass_accuracy(logits, y, k, top_k=min(5, k), average="micro"),
        })

    def configure_optimizers(self):
        hp = self.hparams
        kwargs = {"momentum": hp.momentum, "nesterov": hp.nesterov} if hp.optimizer == "sgd" else {}
        opt = build_optimizer(hp.optimizer, self, hp.weight_decay, lr=hp.lr, **kwargs)
        sched = warmup_cosine(opt, hp.warmup_steps, run_length(self, hp.total_steps), hp.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": per_step(sched)}
