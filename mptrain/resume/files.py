"""Checkpoint files written atomically and read safely.

Write: into a temp file in the target's folder, fsync, ``os.replace``, fsync the folder (a killed save leaves the
previous file intact; the next save removes the orphan).  Read: the CRC32 of every zip record verified, then
``torch.load(weights_only=True)`` only.  Every failure is a :class:`CheckpointError` naming the file and what is
wrong (a damaged file says so); a missing file is a :class:`CheckpointNotFoundError`, also a ``FileNotFoundError``.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from mptrain.resume.errors import CheckpointError, CheckpointNotFoundError

_TMP_SUFFIX = ".mptrain-tmp"


def atomic_save(obj: Any, path: Union[str, os.PathLike]) -> None:
    """``torch.save(obj)`` into ``path`` atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for orphan in path.parent.glob(f".*{_TMP_SUFFIX}"):  # left by a save killed before its rename
        orphan.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def verified_load(path: Union[str, os.PathLike], map_location: Optional[Callable] = None) -> Any:
    """What :func:`atomic_save` wrote, checked record by record and unpickled with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path} (it does not exist or is not a file; "
                                      f"check ckpt_path)")
    _verify_zip(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = [line.strip() for line in str(e).splitlines() if "Unsupported global" in line]
        if not refused:
            raise _damaged(path, _first_line(e)) from None
        raise CheckpointError(f"refused to load checkpoint {str(path)!r}: it holds Python objects other than "
                              f"tensors and plain containers, so unpickling it could run code. Load only "
                              f"checkpoints you trust; a type you trust can be allowed with "
                              f"torch.serialization.add_safe_globals. Detail: {refused[0]}") from None
    except Exception as e:  # noqa: BLE001 - any other failure to read is a damaged file
        raise _damaged(path, f"{type(e).__name__}: {_first_line(e)}") from None


def _verify_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise _damaged(path, "not a torch.save zip archive (truncated, or not a checkpoint)")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every record and checks its CRC32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _damaged(path, _first_line(e)) from None
    if bad is not None:
        raise _damaged(path, f"record {bad!r} fails its CRC32 check")


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(path)!r} is damaged: {what}. Resume from another checkpoint (an earlier "
                           f"one, or the run's last.ckpt)")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
