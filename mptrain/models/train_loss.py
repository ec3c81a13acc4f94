"""The training loss as the recipe models log it."""
from __future__ import annotations

import torch


def log_train_loss(module, loss: torch.Tensor) -> None:
    """``train/loss`` to the loggers every ``log_every_n_steps``; in the progress bar only on the CPU.

    Lightning converts every progress-bar value to a Python number after each batch: for a
    CUDA tensor that is a host sync per step, which stalls the host until the GPU has
    finished the step (mptrain's master modes otherwise run without one).  The loggers read
    the value only on logging steps."""
    module.log("train/loss", loss.detach(), prog_bar=not loss.is_cuda)
