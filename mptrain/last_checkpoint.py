"""``fit(ckpt_path="last")``: the newest "last" checkpoint of the run's root.

Lightning looks in the checkpoint folder of *this* run only; with a logger that folder is the logger's new version
(``version_1``) while the run to resume wrote into ``version_0``, so it warns and trains from scratch.  Here the
folders searched are each ``ModelCheckpoint``'s own (its ``dirpath``, or the logger's ``log_dir``/checkpoints, or
``default_root_dir``/checkpoints) plus, where the folder comes from the logger, the checkpoint folders of every
version of that logger (``<save_dir>/<name>/*/checkpoints``) and an ``OnExceptionCheckpoint``'s file; the newest
file (modification time, Lightning's rule) wins.  Where there is none, ``"last"`` goes to Lightning unchanged: it
warns that there is no last checkpoint and starts a new run.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint


def find_last_checkpoint(trainer: Any) -> Optional[str]:
    """The path ``fit(ckpt_path="last")`` resumes from, or None where there is none (Lightning's case then)."""
    found: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            found.add(callback.ckpt_path)
        elif isinstance(callback, ModelCheckpoint):
            found |= callback._find_last_checkpoints(trainer)
            if callback.dirpath is None and trainer.loggers:
                found |= _last_files(callback, os.path.join(_logger_root(trainer), "*", "checkpoints"))
    # a file, or a folder (a sharded checkpoint)
    times = {path: fs.modified(path) for path in found if (fs := get_filesystem(path)).exists(path)}
    return max(times, key=times.get) if times else None


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
