"""ResumeState: Lightning's callback entry point to :mod:`mptrain.resume` (every rank's RNG state and the epoch's
layout in the checkpoint, restored and checked where training resumes).

Lightning's checkpoint holds the loops' progress and the loader's position; a bitwise resume also needs the RNGs that
dropout, augmentation and the next shuffle draw from (torch CPU and CUDA, NumPy, Python), restored at
``on_train_start``: after Lightning rebuilt the data iterator, before the first resumed step (at an epoch's end with a
loader without length and no loader state, right before Lightning builds that iterator).  The saved RNG is the
training stream's: validation inside ``fit`` draws from a copy (restored when it ends), so a resume that skips a
validation the original run did (a checkpoint written just before it) sees the same stream, and a checkpoint written
after ``fit`` holds the RNG and loader position training ended with.  A checkpoint written at an epoch's end starts
the next epoch as the uninterrupted run did, and one written after a ``fit`` stopped mid-epoch continues that epoch
(:mod:`mptrain.resume.loop_position`).  A mid-epoch resume whose epoch is laid out differently (world size,
batches per epoch, accumulation) would replay the wrong batches silently: it is refused.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.utilities.data import sized_len
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from mptrain.compat.lightning import before_train_iterator, combined_loader, is_stateful, loader_states
from mptrain.resume.errors import CheckpointError
from mptrain.resume.loop_position import (begin_next_epoch, ends_an_epoch, reopen_stopped_epoch, settle_epoch_end,
                                          stopped_mid_epoch)
from mptrain.resume.rng import rng_state, set_rng_state
from mptrain.resume.state import (LAYOUT_KEYS, check_layout, epoch_layout, gather_rng, isolate_validation,
                                  warn_if_order_not_restorable)


class ResumeState(Callback):
    """Saves the RNG state of every rank and the epoch's layout; restores them on resume."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] | None = None
        self._trainer = None
        self._next_epoch_loaders: Optional[list] = None  # set when the checkpoint ends an epoch
        self._training_rng: Optional[dict[str, Any]] = None  # while validation runs inside fit
        self._fit_end: Optional[dict[str, Any]] = None  # the RNG and loader states fit ended with
        self._restored_early: Optional[dict[str, Any]] = None  # see before_train_iterator

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer
        self._next_epoch_loaders = None
        self._restored_early: Optional[dict[str, Any]] = None  # the saved layout, once the RNG is restored early
        if stage == TrainerFn.FITTING:
            self._fit_end = None
            isolate_validation(trainer, self)
            before_train_iterator(trainer.fit_loop, self.before_train_iterator)

    def before_train_iterator(self) -> None:
        """Lightning is about to build the train iterator of a run resumed at an epoch's end.  A loader without
        length is read a batch ahead at once: with no loader state to rebuild, the RNG is restored now, so this
        iterator is the next epoch's, as the uninterrupted run built it, and no second one is built (a dataset
        reading an external source, a queue, would lose what the first one read)."""
        trainer = self._trainer
        if self._next_epoch_loaders != [] or self._restored_early is not None or not self._loaded:
            return
        combined = combined_loader(trainer.fit_loop)
        if combined is None or all(sized_len(loader) is not None for loader in combined.flattened) \
                or any(is_stateful(loader) for loader in combined.flattened):
            return
        self._restored_early = {"layout": self._loaded.get("layout")}
        self._restore_rng(trainer)

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:
            return {}
        rng = self._training_rng or (self._fit_end or {}).get("rng") or rng_state()
        return {"rng": gather_rng(rng), "layout": epoch_layout(self._trainer)}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # after fit, Lightning has let go of the loader's iterator: save the position training ended at
        loaders = (self._fit_end or {}).get("loaders")
        if loaders and isinstance(checkpoint.get("loops"), dict):
            checkpoint["loops"].get("fit_loop", {}).setdefault("state_dict", {})["combined_loader"] = loaders

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        fit_loop = (checkpoint.get("loops") or {}).get("fit_loop")
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(fit_loop, dict):
            return
        if self.state_key not in (checkpoint.get("callbacks") or {}):
            # not written by mptrain's Trainer (e.g. by lightning.Trainer): resumed as Lightning resumes it
            rank_zero_warn(f"checkpoint {trainer.ckpt_path!r} holds no ResumeState (not written by mptrain's Trainer): "
                           f"it is resumed as Lightning resumes it; the exact-resume guarantee needs mptrain's own "
                           f"checkpoints")
            return
        if ends_an_epoch(fit_loop):
            self._next_epoch_loaders = settle_epoch_end(fit_loop)
        elif stopped_mid_epoch(fit_loop):
            reopen_stopped_epoch(fit_loop, trainer.accumulate_grad_batches)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict
        layout = state_dict.get("layout")
        if self._trainer is not None and isinstance(layout, dict) and set(LAYOUT_KEYS) <= set(layout):
            # Refused before Lightning hands the loader state to a sampler of another kind (1 process ->
            # DistributedSampler), which fails with a bare AssertionError; batches per epoch come at on_train_start.
            check_layout(layout, epoch_layout(self._trainer), ("world_size", "accumulate_grad_batches"))

    def on_train_start(self, trainer, pl_module) -> None:
        early, self._restored_early = self._restored_early, None
        saved = early["layout"] if early is not None else (self._loaded or {}).get("layout")
        if early is None:
            self._restore_rng(trainer)
        if self._next_epoch_loaders is not None:
            loaders, self._next_epoch_loaders = self._next_epoch_loaders, None
            now = epoch_layout(trainer)
            same = not isinstance(saved, dict) or all(saved.get(k) == now[k]
                                                      for k in ("world_size", "num_training_batches"))
            begin_next_epoch(trainer, loaders, same_layout=same, iterate_unsized=early is None)

    def on_train_end(self, trainer, pl_module) -> None:
        combined = combined_loader(trainer.fit_loop)
        self._fit_end = {"rng": rng_state(), "loaders": loader_states(combined) if combined is not None else []}

    def _restore_rng(self, trainer) -> None:
        if not self._loaded:  # a checkpoint of lightning.Trainer: on_load_checkpoint said so
            return
        saved, self._loaded = self._loaded, None
        layout = saved.get("layout")
        if not isinstance(saved.get("rng"), list) or not saved["rng"] or not isinstance(layout, dict) \
                or not set(LAYOUT_KEYS) <= set(layout):
            raise CheckpointError(f"checkpoint {trainer.ckpt_path!r}: its ResumeState entry is damaged (keys "
                                  f"{sorted(saved)}; expected a non-empty 'rng' list and a 'layout' dict with "
                                  f"{list(LAYOUT_KEYS)})")
        check_layout(layout, epoch_layout(trainer))
        warn_if_order_not_restorable(trainer, layout)
        set_rng_state(saved["rng"][trainer.global_rank % len(saved["rng"])])
