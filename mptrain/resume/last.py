"""``fit(ckpt_path="last")``: the newest "last" checkpoint of the run's root.

Lightning looks in the checkpoint folder of *this* run only; with a logger that folder is the logger's new version
(``version_1``) while the run to resume wrote into ``version_0``, so it warns and trains from scratch.  Where
Lightning's own search (each ``ModelCheckpoint``'s folder, an ``OnExceptionCheckpoint``'s file) finds nothing, the
checkpoint folders of every version of the logger (``<save_dir>/<name>/*/checkpoints``) are searched too, for the
``ModelCheckpoint`` whose folder comes from the logger; the newest file (modification time, Lightning's rule) wins.
Where there is none, ``"last"`` goes to Lightning unchanged: it warns and starts a new run.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from mptrain.compat.lightning import last_checkpoints


def find_last_checkpoint(trainer: Any) -> Optional[str]:
    """The newest "last" checkpoint in the version folders of the run's logger, where Lightning's own search (this
    run's folders) finds none; None: ``"last"`` goes to Lightning as it is."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    own = {getattr(c, "ckpt_path", None) for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)}
    for callback in callbacks:
        own |= last_checkpoints(callback, trainer)
    if _newest(own) is not None or not trainer.loggers:
        return None  # Lightning finds it, or there is nowhere else to look
    pattern = os.path.join(_logger_root(trainer), "*", "checkpoints")
    return _newest({path for c in callbacks if getattr(c, "dirpath", None) is None for path in _last_files(c, pattern)})


def _newest(paths: set) -> Optional[str]:
    """The most recently modified of ``paths`` that exist (files, or folders: sharded checkpoints), Lightning's rule."""
    times = {path: fs.modified(path) for path in paths if path and (fs := get_filesystem(path)).exists(path)}
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
