"""Checkpoints: atomic writes, ``weights_only`` loads, clear errors.

A checkpoint is written to a temp file in the same folder, flushed, fsync'd and
``os.replace``d over the target, so ``last.ckpt`` is always either the previous
complete file or the new complete file.  Loading uses ``torch.load(weights_only=True)``
only: a file carrying a pickled object is refused and its payload never runs.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format", "state_dict", "optimizer", "epoch", "global_step", "batch_idx", "precision")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, unsafe or not an mptrain checkpoint."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def link_or_copy_atomic(src: Path, dst: Path) -> None:
    """Make ``dst`` a complete copy of ``src`` atomically (hard link when possible)."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil

        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    try:
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(dst.parent)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load an mptrain checkpoint safely; every failure names the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file); check ckpt_path")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refused to load checkpoint {str(path)!r}: it holds Python objects that are not tensors or plain "
            f"containers, so loading it could run code (weights_only=True). Only load checkpoints written by "
            f"mptrain from sources you trust. Detail: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    except (EOFError, zipfile.BadZipFile, RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or not a torch checkpoint ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); use another checkpoint, e.g. an earlier step-N.ckpt"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not an mptrain checkpoint dict")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not an mptrain checkpoint: missing key(s) {missing} "
            f"(a Lightning checkpoint's weights are under 'state_dict'; load them with model.load_state_dict)"
        )
    if state["format"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {state['format']}, newer than this mptrain ({FORMAT_VERSION}); upgrade mptrain"
        )
    return state


def resolve_ckpt_path(ckpt_path: str | os.PathLike | None, checkpoint_dir: Path) -> Path | None:
    """``"last"`` means ``<checkpoint_dir>/last.ckpt``, ``"auto"`` that file if it exists (else
    no resume); a path is used as given."""
    if ckpt_path is None:
        return None
    if str(ckpt_path) == "auto":  # resume if a run left last.ckpt here, else start fresh
        last = checkpoint_dir / "last.ckpt"
        return last if last.is_file() else None
    if str(ckpt_path) == "last":
        last = checkpoint_dir / "last.ckpt"
        if not last.is_file():
            raise CheckpointError(
                f"ckpt_path='last' but {str(last)!r} does not exist: no checkpoint has been written under "
                f"default_root_dir yet (pass checkpoint_every_n_steps, or a path)"
            )
        return last
    return Path(ckpt_path)
