"""ResumeState: every rank's RNG state in the checkpoint, restored where training resumes.

Lightning's checkpoint holds the loops' progress and the loader's position; a bitwise resume also needs the RNGs that
dropout, augmentation and the next shuffle draw from (torch CPU and CUDA, NumPy, Python), restored at
``on_train_start``: after Lightning rebuilt the data iterator, before the first resumed step.  A mid-epoch resume
whose epoch is laid out differently (world size, batches per epoch, accumulation) would replay the wrong batches
silently: it is refused.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from mptrain.callbacks.resumable_loader import order_not_restorable
from mptrain.callbacks.rng import rng_state, set_rng_state
from mptrain.checkpoint import CheckpointError


class ResumeState(Callback):
    """Saves the RNG state of every rank and the epoch's layout; restores them on resume."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] | None = None
        self._trainer = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:
            return {}
        return {"rng": _gather(rng_state()), "layout": _layout(self._trainer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict
        layout = state_dict.get("layout")
        if self._trainer is not None and isinstance(layout, dict) and set(_LAYOUT_KEYS) <= set(layout):
            # Refused before Lightning hands the loader state to a sampler of another kind (1 process ->
            # DistributedSampler), which fails with a bare AssertionError; batches per epoch come at on_train_start.
            _check_layout(layout, _layout(self._trainer), ("world_size", "accumulate_grad_batches"))

    def on_train_start(self, trainer, pl_module) -> None:
        if not self._loaded:
            if trainer.ckpt_path is not None:
                rank_zero_warn(f"checkpoint {trainer.ckpt_path!r} holds no ResumeState (not written by mptrain's "
                               f"Trainer): the RNG is not restored, so this run will not repeat the original one")
            return
        saved, self._loaded = self._loaded, None
        layout = saved.get("layout")
        if not isinstance(saved.get("rng"), list) or not saved["rng"] or not isinstance(layout, dict) \
                or not set(_LAYOUT_KEYS) <= set(layout):
            raise CheckpointError(f"checkpoint {trainer.ckpt_path!r}: its ResumeState entry is damaged (keys "
                                  f"{sorted(saved)}; expected a non-empty 'rng' list and a 'layout' dict with "
                                  f"{list(_LAYOUT_KEYS)})")
        _check_layout(layout, _layout(trainer))
        _warn_if_order_not_restorable(trainer, layout)
        set_rng_state(saved["rng"][trainer.global_rank % len(saved["rng"])])


_LAYOUT_KEYS = ("world_size", "accumulate_grad_batches", "num_training_batches", "batch_in_epoch")


def _layout(trainer) -> dict[str, int]:
    batches = trainer.num_training_batches
    return {
        "world_size": trainer.world_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "num_training_batches": -1 if batches == float("inf") else int(batches),
        "batch_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
    }


def _check_layout(saved: dict[str, int], now: dict[str, int],
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


def _warn_if_order_not_restorable(trainer, saved: dict[str, int]) -> None:
    if 0 < saved["batch_in_epoch"] < saved["num_training_batches"]:
        loaders = trainer.fit_loop._combined_loader.flattened
        culprits = [name for loader in loaders for name in order_not_restorable(loader)]
        if culprits:
            rank_zero_warn(f"resuming mid-epoch with {', '.join(culprits)}: it keeps no state, so the rest of this "
                           f"epoch may visit other samples than the uninterrupted run; give it state_dict() / "
                           f"load_state_dict(), or resume from an end-of-epoch checkpoint")


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states
