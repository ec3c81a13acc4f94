"""Every random generator a training step draws from, as checkpointable state (tensors and plain values)."""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's torch (CPU, and CUDA once initialized), NumPy and Python RNG states, checkpointable."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Whatever the block draws, the RNGs of :func:`rng_state` leave it as they entered."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def _as_tuples(value: Any) -> Any:
    """Python's RNG state is nested tuples; a checkpoint round trip may return lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
