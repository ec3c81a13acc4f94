"""Lightning's private names, each behind one small function saying which public API is missing."""
from __future__ import annotations

import typing
from typing import Any


def precision_inputs() -> tuple[Any, ...]:
    """Every value ``lightning.pytorch.Trainer(precision=...)`` accepts.
    Missing public API: the accepted precision values (only the private ``_PRECISION_INPUT`` type lists them)."""
    from lightning.fabric.connector import _PRECISION_INPUT

    return tuple(value for literal in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(literal))
