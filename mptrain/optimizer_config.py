"""Turn what ``configure_optimizers`` returns into one optimizer and its LR schedulers.

Accepts Lightning's forms: an optimizer; a list/tuple of one; ``([opt], [sched])``;
``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": s, "interval", "frequency", "monitor"}}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"  # "epoch" or "step"
    frequency: int = 1
    monitor: Optional[str] = None


def _sched_config(s: Any) -> SchedulerConfig:
    if isinstance(s, dict):
        if "scheduler" not in s:
            raise ValueError(f"configure_optimizers: an lr_scheduler dict needs a 'scheduler' key, got keys {sorted(s)}")
        cfg = SchedulerConfig(s["scheduler"], s.get("interval", "epoch"), int(s.get("frequency", 1)), s.get("monitor"))
    else:
        cfg = SchedulerConfig(s)
    if cfg.interval not in ("epoch", "step"):
        raise ValueError(f"configure_optimizers: lr_scheduler interval={cfg.interval!r}; valid: 'epoch', 'step'")
    return cfg


def parse_optimizers(out: Any) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    """(optimizer, scheduler configs) from any of Lightning's return forms."""
    scheds: list = []
    if isinstance(out, torch.optim.Optimizer):
        return out, []
    if isinstance(out, dict):
        if "optimizer" not in out:
            raise ValueError(f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(out)})")
        opt = out["optimizer"]
        if out.get("lr_scheduler") is not None:
            scheds = [out["lr_scheduler"]]
    elif isinstance(out, (list, tuple)) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        opts, scheds = list(out[0]), list(out[1]) if isinstance(out[1], (list, tuple)) else [out[1]]
        if len(opts) != 1:
            raise NotImplementedError(f"mptrain trains with one optimizer; configure_optimizers returned {len(opts)}")
        opt = opts[0]
    elif isinstance(out, (list, tuple)):
        if len(out) != 1:
            raise NotImplementedError(f"mptrain trains with one optimizer; configure_optimizers returned {len(out)}")
        opt = out[0]
        if isinstance(opt, dict):
            return parse_optimizers(opt)
    else:
        raise TypeError(
            f"configure_optimizers returned {type(out).__name__}; expected an optimizer, a list, a tuple "
            f"([optimizers], [schedulers]) or a dict with 'optimizer' and optionally 'lr_scheduler'"
        )
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers: expected a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt, [_sched_config(s) for s in scheds]
