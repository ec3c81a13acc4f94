"""Precision modes as Lightning precision plugins (DESIGN §2); ``precision_plugin(string)`` builds the right one."""
from __future__ import annotations

from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision.factory import (PRECISIONS, build_precision, check_device_supports, normalize_precision,
                                       precision_plugin)
from mptrain.precision.fp8 import Fp8Precision
from mptrain.precision.loss_scaler import DynamicLossScaler, NonFiniteError
from mptrain.precision.master import MasterPrecision
from mptrain.precision.mixed import MixedPrecision
from mptrain.precision.plugin import MptrainPrecision
from mptrain.precision.sharded import ShardedPrecision
from mptrain.precision.sr import StochasticRoundingPrecision
from mptrain.precision.true import TruePrecision

__all__ = ["PRECISIONS", "normalize_precision", "precision_plugin", "build_precision", "check_device_supports",
           "MptrainPrecision", "MasterPrecision", "Fp8Precision", "MixedPrecision", "TruePrecision", "ShardedPrecision",
           "StochasticRoundingPrecision", "DynamicLossScaler", "NonFiniteError", "HALF_DTYPES"]
