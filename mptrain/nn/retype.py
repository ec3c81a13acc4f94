"""retype: turn an exact torch module into a drop-in subclass in place (its class changes; its parameters,
weight tying, hooks and settings stay as they are)."""
from __future__ import annotations

from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def retype(module: nn.Module, base: type[nn.Module], cls: type[M], caller: str) -> M:
    """``module`` itself, now a ``cls``.  Only an exact ``base`` is taken: a user's subclass may override
    forward, which the new class would silently replace (``caller`` names the entry point in the error)."""
    if type(module) is not base:
        raise TypeError(f"{caller} takes an nn.{base.__name__}, got {type(module).__name__}")
    module.__class__ = cls
    return module
