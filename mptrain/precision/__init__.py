"""Precision modes: the strings are the public API (DESIGN §2).

``build_precision(name, ...)`` is the one place a precision string becomes an object;
an unknown string raises ``ValueError`` listing the valid ones, and a bf16 mode on a
GPU without bf16 raises before any training.
"""
from __future__ import annotations

from typing import Any

import torch

from mptrain.precision.base import Precision
from mptrain.precision.master import MasterPrecision
from mptrain.precision.mixed import MixedPrecision
from mptrain.precision.true import TruePrecision

PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "16-master", "bf16-master")

_ALIASES = {"32": "32-true", 32: "32-true", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}


def normalize_precision(name: Any) -> str:
    """Check a precision string (Lightning's short aliases accepted) and return the canonical one."""
    name = _ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is not supported. Valid values: {', '.join(PRECISIONS)}")
    return name


def check_device_supports(name: str, device: torch.device) -> None:
    """bf16 on a GPU without bf16 (pre-Ampere) must fail before training, not produce garbage."""
    if device.type == "cuda" and name.startswith("bf16"):
        if not torch.cuda.is_bf16_supported(including_emulation=False) if _has_emulation_arg() else not torch.cuda.is_bf16_supported():
            cap = torch.cuda.get_device_capability(device)
            raise RuntimeError(
                f"precision={name!r} needs a GPU with bf16 support (compute capability >= 8.0); "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. Use '16-master' or '16-mixed' instead."
            )


def _has_emulation_arg() -> bool:
    import inspect

    try:
        return "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    except (TypeError, ValueError):
        return False


def build_precision(name: str, device: torch.device | str = "cpu", fp32_fallback: Any = "default") -> Precision:
    """The Precision object for ``name`` (one of PRECISIONS) on ``device``."""
    name = normalize_precision(name)
    device = torch.device(device)
    check_device_supports(name, device)
    if name.endswith("-true"):
        return TruePrecision(name, device, fp32_fallback)
    if name.endswith("-mixed"):
        return MixedPrecision(name, device, fp32_fallback)
    return MasterPrecision(name, device, fp32_fallback)


__all__ = ["PRECISIONS", "Precision", "build_precision", "normalize_precision", "MasterPrecision", "MixedPrecision", "TruePrecision"]
