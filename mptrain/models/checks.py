"""Argument checks the models run in ``__init__``: a bad hyperparameter fails when the model
is built (the CLI reports it as one line, exit 2), not at the first optimizer step."""
from __future__ import annotations

from typing import Any


def check_args(group: str = "model", **rules: tuple[Any, str]) -> None:
    """``name=(value, rule)`` with rule ``">0"``, ``">=0"``, ``">=1"`` or ``"[0,1)"``;
    ValueError naming ``group.name``, the value and what is valid."""
    for name, (value, rule) in rules.items():
        if value is None:
            continue
        ok = {">0": value > 0, ">=0": value >= 0, ">=1": value >= 1, "[0,1)": 0 <= value < 1}[rule]
        if not ok:
            valid = {">0": "> 0", ">=0": ">= 0", ">=1": ">= 1", "[0,1)": "in [0, 1)"}[rule]
            raise ValueError(f"{group}.{name}={value!r} is invalid: it must be {valid}")
