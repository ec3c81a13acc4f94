"""Casting batches: floating tensors become the mode's dtype; everything else is left alone."""
from __future__ import annotations

from typing import Any

import torch


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Recursively cast floating-point tensors in tensors, dicts, lists, tuples and dataclass-free containers."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, dict):
        return type(data)((k, cast_floating(v, dtype)) for k, v in data.items()) if type(data) is dict else {
            k: cast_floating(v, dtype) for k, v in data.items()
        }
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(cast_floating(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floating(v, dtype) for v in data)
    return data
