"""Precision strings -> plugins: the one place a string (ours or Lightning's alias) becomes an object."""
from __future__ import annotations

from typing import Any

import torch

from mptrain.precision.fp8 import Fp8Precision
from mptrain.precision.master import MasterPrecision
from mptrain.precision.mixed import MixedPrecision
from mptrain.precision.plugin import MptrainPrecision, check_device_supports
from mptrain.precision.sharded import ShardedPrecision
from mptrain.precision.sr import StochasticRoundingPrecision
from mptrain.precision.true import TruePrecision

PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "16-master", "bf16-master",
                                 "fp8-master", "bf16-sr")

# Lightning's short spellings (lightning.fabric.connector's table, minus 64-true which we do not run).
_ALIASES: dict[Any, str] = {32: "32-true", "32": "32-true", 16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed"}


def normalize_precision(precision: Any) -> str:
    """The canonical string for ``precision`` (Lightning's aliases accepted); ValueError listing the valid ones."""
    name = _ALIASES.get(precision, precision) if isinstance(precision, (int, float, str)) else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported. Valid values: {', '.join(PRECISIONS)} "
                         f"(and Lightning's aliases 32, '32', 16, '16', 'bf16')")
    return name


def precision_plugin(precision: Any, *, sharded: bool = False, **kwargs: Any) -> MptrainPrecision:
    """The plugin for a precision string (``loss_scaler``, ``fp32_fallback``, ``fused``, ``max_consecutive_skips``);
    ``sharded=True``: the :class:`ShardedPrecision` that ``strategy="fsdp"`` needs."""
    name = normalize_precision(precision)
    if sharded:
        return ShardedPrecision(name, **kwargs)
    if name == "fp8-master":
        return Fp8Precision(name, **kwargs)
    if name == "bf16-sr":
        return StochasticRoundingPrecision(name, **kwargs)
    cls = MasterPrecision if name.endswith("-master") else MixedPrecision if name.endswith("-mixed") else TruePrecision
    return cls(name, **kwargs)


def build_precision(name: Any, device: torch.device | str = "cpu", fp32_fallback: Any = "default") -> MptrainPrecision:
    """A plugin checked against ``device`` (numerics tools convert a module outside any trainer with it)."""
    name = normalize_precision(name)
    check_device_supports(name, torch.device(device))
    return precision_plugin(name, fp32_fallback=fp32_fallback)
