"""Precision modes as Lightning precision plugins (DESIGN §2): the strings are the public API.

``lightning.Trainer(plugins=[MasterPrecision("bf16-master")])`` and
``lightning.Fabric(plugins=[...])`` take them as they are; ``precision_plugin(string)``
builds the right one from any precision string; ``ShardedPrecision`` is the engine under
``strategy="fsdp"``.
"""
from __future__ import annotations

from mptrain.precision.factory import (PRECISIONS, build_precision, check_device_supports, normalize_precision,
                                       precision_plugin)
from mptrain.precision.loss_scaler import DynamicLossScaler, NonFiniteError
from mptrain.precision.master import MasterPrecision
from mptrain.precision.mixed import MixedPrecision
from mptrain.precision.plugin import MptrainPrecision
from mptrain.precision.sharded import ShardedPrecision
from mptrain.precision.true import TruePrecision

__all__ = ["PRECISIONS", "normalize_precision", "precision_plugin", "build_precision", "check_device_supports",
           "MptrainPrecision", "MasterPrecision", "MixedPrecision", "TruePrecision", "ShardedPrecision", "DynamicLossScaler",
           "NonFiniteError"]
