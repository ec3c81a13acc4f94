"""The training loss as the recipe models log it."""
from __future__ import annotations

import torch


def log_train_loss(module, loss: torch.Tensor) -> torch.Tensor:
    """Log ``loss`` as ``train/loss`` and return it: to the loggers every ``log_every_n_steps``; in the progress bar
    only on the CPU (Lightning reads every progress-bar value after each batch: for a CUDA tensor a host sync)."""
    module.log("train/loss", loss.detach(), prog_bar=not loss.is_cuda)
    return loss
