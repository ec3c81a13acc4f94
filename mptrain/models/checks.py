"""Argument checks the models run in ``__init__``: a bad hyperparameter fails when the model
is built (the CLI reports it as one line, exit 2), not at the first optimizer step."""
from __future__ import annotations

from typing import Any

_RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "in [0, 1)": lambda v: 0 <= v < 1}


def check_args(group: str = "model", **rules: tuple[Any, str]) -> None:
    """``name=(value, rule)`` with a rule of ``_RULES`` (None values pass); ValueError naming ``group.name``, the
    value and what is valid."""
    for name, (value, rule) in rules.items():
        if value is not None and not _RULES[rule](value):
            raise ValueError(f"{group}.{name}={value!r} is invalid: it must be {rule}")
