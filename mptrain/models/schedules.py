"""Learning-rate schedules the recipes use, as ``LambdaLR`` multipliers stepped every optimizer
step, and the number of steps a run will take."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def run_length(module, fixed: Optional[int], default: int = 10_000) -> Callable[[], int]:
    """Optimizer steps of the whole run: ``fixed``, or a function asking the attached trainer each time (a schedule
    built in ``configure_optimizers`` may be built before it has counted its batches), ``default`` while it cannot
    tell (no trainer attached, 0 batches counted yet, an infinite run)."""
    if fixed:
        return lambda: int(fixed)

    def estimate() -> int:
        try:
            est = int(module.trainer.estimated_stepping_batches)
        except (AttributeError, RuntimeError, TypeError, ValueError, OverflowError):
            return default
        return est if est > 0 else default

    return estimate


def _warmup_then(optimizer: torch.optim.Optimizer, warmup_steps: int, total: Callable[[], int],
                 decay: Callable[[float], float]):
    """Linear warm-up from ~0 to the base LR over ``warmup_steps``, then ``decay(progress)``
    with progress going from 0 after the warm-up to 1 at step ``total()``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return decay(min(1.0, (step - warmup_steps) / max(1, total() - warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total: Callable[[], int],
                  min_ratio: float = 0.0):
    """Linear warm-up, then cosine to ``min_ratio`` at step ``total()``."""
    return _warmup_then(optimizer, warmup_steps, total,
                        lambda p: min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def warmup_linear(optimizer: torch.optim.Optimizer, warmup_steps: int, total: Callable[[], int]):
    """Linear warm-up, then linear decay to 0 at step ``total()`` (BERT's schedule)."""
    return _warmup_then(optimizer, warmup_steps, total, lambda p: 1.0 - p)


def per_step(scheduler) -> dict:
    """Lightning's scheduler config for a per-optimizer-step schedule."""
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}
