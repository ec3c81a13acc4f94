"""AtomicCheckpointIO: Lightning's checkpoint format, written atomically, read safely.

Save: into a temp file in the target's folder, fsync, ``os.replace``, fsync the folder (a killed save
leaves the previous file intact; the next save removes the orphan).  Whatever Lightning hands over is written,
as ``TorchCheckpointIO`` writes it (a full checkpoint, or the bare weights ``strategy="ddp_spawn"`` passes back).
Load: CRC32 of every zip record verified, then ``torch.load(weights_only=True)`` only.  Every failure
is a :class:`CheckpointError` naming the file and what is wrong; a missing file is also a ``FileNotFoundError``,
as in Lightning.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

_TMP_SUFFIX = ".mptrain-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, unsafe to unpickle or not a Lightning checkpoint."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file does not exist: Lightning raises ``FileNotFoundError`` there, so this is one too."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """A Lightning ``CheckpointIO`` plugin: atomic local writes, ``weights_only`` verified reads; remote
    (``scheme://``) paths go through Lightning's ``TorchCheckpointIO``.  ``mptrain.Trainer`` adds it by default."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if _is_remote(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r})")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for orphan in path.parent.glob(f".*{_TMP_SUFFIX}"):  # left by a save killed before its rename
            orphan.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if _is_remote(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        if weights_only is False:
            raise CheckpointError(f"refused to load {str(path)!r} with weights_only=False: AtomicCheckpointIO only "
                                  "unpickles tensors and plain containers (register extra types with "
                                  "torch.serialization.add_safe_globals)")
        path = Path(path)
        if not path.is_file():
            raise CheckpointNotFoundError(f"Checkpoint file not found: {path} (it does not exist or is not a file; "
                                          f"check ckpt_path)")
        _verify_zip(path)
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"refused to load checkpoint {str(path)!r}: it holds Python objects other than "
                                  f"tensors and plain containers, so unpickling it could run code. Load only "
                                  f"checkpoints you trust; a type you trust can be allowed with "
                                  f"torch.serialization.add_safe_globals. Detail: {_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - any other failure to read is a damaged file
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be read "
                                  f"({type(e).__name__}: {_first_line(e)})") from None
        return state


def _verify_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a torch.save zip archive "
                              "(truncated, or not a checkpoint)")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every record and checks its CRC32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {_first_line(e)}") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: record {bad!r} fails its CRC32 check")


def _is_remote(path: _PATH) -> bool:
    return "://" in str(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

