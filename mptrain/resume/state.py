"""What ResumeState adds to a checkpoint and checks on resume: every rank's RNG state (gathered), the epoch's
layout (world size, accumulation, batches per epoch, position), and validation inside ``fit`` run on a copy of the
training RNG."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from mptrain.compat.lightning import combined_loader
from mptrain.resume.loader import order_not_restorable
from mptrain.resume.rng import rng_state, set_rng_state


def isolate_validation(trainer, owner: Any) -> None:
    """Validation inside fit runs on a copy of the training RNG: its run, and the skip a resumed run makes of one
    the checkpoint was written before (both build the val loader's iterator, which draws a seed)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    for name in ("run", "increment_progress_to_evaluation_end"):
        if name not in vars(val_loop):  # Lightning's own method; one set on the loop (a user's, ours) stays
            setattr(val_loop, name, _OnRngCopy(val_loop, name, owner))


class _OnRngCopy:
    """``loop.<name>`` run on a copy of the RNG, restored when it returns (a picklable callable: the Trainer and
    everything it holds pickle)."""

    def __init__(self, loop: Any, name: str, owner: Any):
        self.loop, self.name, self.owner = loop, name, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        owner._training_rng = rng_state()
        try:
            return getattr(type(self.loop), self.name)(self.loop, *args, **kwargs)
        finally:
            set_rng_state(owner._training_rng)
            owner._training_rng = None


LAYOUT_KEYS = ("world_size", "accumulate_grad_batches", "num_training_batches", "batch_in_epoch")


def epoch_layout(trainer) -> dict[str, int]:
    batches = trainer.num_training_batches
    return {
        "world_size": trainer.world_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "num_training_batches": -1 if batches == float("inf") else int(batches),
        "batch_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
    }


def check_layout(saved: dict[str, int], now: dict[str, int],
                  keys: tuple[str, ...] = ("world_size", "accumulate_grad_batches", "num_training_batches")) -> None:
    position = saved["batch_in_epoch"]
    if position == 0 or position >= saved["num_training_batches"] > 0:
        return  # an epoch boundary: any new layout starts a fresh epoch
    changed = {k: (saved[k], now[k]) for k in keys if saved[k] != now[k]}
    if changed:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        raise ValueError(
            f"cannot resume mid-epoch (batch {position} of {saved['num_training_batches']}) with a different epoch "
            f"layout: {what}. Resume with the saved world size, batch size and accumulate_grad_batches, or from a "
            f"checkpoint written at the end of an epoch."
        )


def warn_if_order_not_restorable(trainer, saved: dict[str, int]) -> None:
    if 0 < saved["batch_in_epoch"] < saved["num_training_batches"]:
        loaders = combined_loader(trainer.fit_loop).flattened
        culprits = [name for loader in loaders for name in order_not_restorable(loader)]
        if culprits:
            rank_zero_warn(f"resuming mid-epoch with {', '.join(culprits)}: it keeps no state, so the rest of this "
                           f"epoch may visit other samples than the uninterrupted run; give it state_dict() / "
                           f"load_state_dict(), or resume from an end-of-epoch checkpoint")


def gather_rng(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state; its tensors travel as NumPy arrays (pickling a tensor goes through torch.save, which
    a project may watch)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _map_tensors(state, lambda t: t.numpy()))
    return [_map_tensors(s, torch.from_numpy, np.ndarray) for s in states]


def _map_tensors(value: Any, fn: Any, kind: type = torch.Tensor) -> Any:
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn, kind) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn, kind) for v in value)
    return value
