"""Exact resume in one place: what a checkpoint holds (:mod:`.state`), the train loader's position (:mod:`.loader`),
the loop position (:mod:`.loop_position`), the RNGs (:mod:`.rng`), finding the last checkpoint (:mod:`.last`),
and checkpoint files written atomically and read safely (:mod:`.files`, :class:`AtomicCheckpointIO`).  Lightning
reaches it through two entry points: the ``ResumeState`` callback and the ``AtomicCheckpointIO`` plugin."""
from __future__ import annotations

from typing import Any

from mptrain.resume.checkpoint_io import AtomicCheckpointIO
from mptrain.resume.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["AtomicCheckpointIO", "CheckpointError", "CheckpointNotFoundError", "attach", "resolve_ckpt_path"]


def attach(trainer: Any) -> None:
    """What a Trainer needs for an exact resume beyond its callback and IO plugin: a train loader that saves its
    position, and a fit loop whose state round-trips."""
    from mptrain.compat.lightning import report_pending_loader_states
    from mptrain.resume.loader import make_train_loader_resumable

    make_train_loader_resumable(trainer)
    report_pending_loader_states(trainer.fit_loop)


def resolve_ckpt_path(trainer: Any, ckpt_path: Any) -> Any:
    """``fit``'s ``ckpt_path``: ``"last"`` becomes the newest last checkpoint of another logger version where
    Lightning's own search finds none (:func:`mptrain.resume.last.find_last_checkpoint`); anything else as it is."""
    if ckpt_path != "last":
        return ckpt_path
    from mptrain.resume.last import find_last_checkpoint

    return find_last_checkpoint(trainer) or ckpt_path
