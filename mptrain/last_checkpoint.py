"""``fit(ckpt_path="last")``: the newest "last" checkpoint of the run's root, or an error naming where it looked.

Lightning looks in the checkpoint folder of *this* run only; with a logger that folder is the logger's new version
(``version_1``) while the run to resume wrote into ``version_0``, so it warns and trains from scratch.  Here the
folders searched are each ``ModelCheckpoint``'s own (its ``dirpath``, or the logger's ``log_dir``/checkpoints, or
``default_root_dir``/checkpoints) plus, where the folder comes from the logger, the checkpoint folders of every
version of that logger (``<save_dir>/<name>/*/checkpoints``) and an ``OnExceptionCheckpoint``'s file; the newest
file (modification time, Lightning's rule) wins.  A resume that was asked for never silently becomes a fresh run.
"""
from __future__ import annotations

import os
import re
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from mptrain.checkpoint import CheckpointError


def find_last_checkpoint(trainer: Any) -> str:
    """The path ``fit(ckpt_path="last")`` resumes from; :class:`CheckpointError` naming the folders when none."""
    callbacks = trainer.checkpoint_callbacks
    if not callbacks:
        raise CheckpointError("fit(ckpt_path='last'): this Trainer has no ModelCheckpoint (enable_checkpointing=False "
                              "and none in callbacks), so it has no 'last' checkpoint to resume; pass the checkpoint's "
                              "path, or ckpt_path=None to start a new run")
    found: set[str] = set()
    searched: list[str] = []
    for callback in callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            searched.append(callback.ckpt_path)
            found.add(callback.ckpt_path)
        elif isinstance(callback, ModelCheckpoint):
            found |= callback._find_last_checkpoints(trainer)
            searched.append(_own_folder(callback, trainer))
            if callback.dirpath is None and trainer.loggers:
                pattern = os.path.join(_logger_root(trainer), "*", "checkpoints")
                searched.append(pattern)
                found |= _last_files(callback, pattern)
    # a file, or a folder (a sharded checkpoint)
    times = {path: fs.modified(path) for path in found if (fs := get_filesystem(path)).exists(path)}
    if not times:
        raise CheckpointError(f"fit(ckpt_path='last') found no last checkpoint (last*.ckpt, written by "
                              f"ModelCheckpoint(save_last=True) or Trainer(checkpoint_every_n_steps=N)); looked in "
                              f"{', '.join(map(repr, dict.fromkeys(searched)))}. Pass the checkpoint's path, or "
                              f"ckpt_path=None to start a new run")
    return max(times, key=times.get)


def _own_folder(callback: ModelCheckpoint, trainer: Any) -> str:
    if callback.dirpath is not None:
        return str(callback.dirpath)
    if trainer.loggers:
        logger = trainer.loggers[0]
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return os.path.join(_logger_root(trainer), version, "checkpoints")
    return os.path.join(str(trainer.default_root_dir), "checkpoints")


def _logger_root(trainer: Any) -> str:
    """Where the first logger keeps its versions: ``<save_dir>/<name>`` (Lightning's checkpoint folder rule)."""
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    return os.path.join(str(save_dir), str(logger.name))


def _last_files(callback: ModelCheckpoint, folders: str) -> set[str]:
    """``callback``'s "last" files (``last.ckpt``, ``last-v1.ckpt``, ...) in the folders a glob pattern names, matched
    as ``ModelCheckpoint`` matches them in its own folder."""
    last = re.compile(rf"^{callback.CHECKPOINT_NAME_LAST}(-(\d+))?")
    extension = callback.FILE_EXTENSION
    paths = get_filesystem(folders).glob(os.path.join(folders, f"*{extension}"))
    return {path if "://" in folders else os.path.normpath(path) for path in paths
            if last.match(os.path.basename(path)[: -len(extension)])}
