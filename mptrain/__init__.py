"""mptrain: mixed-precision training for PyTorch inside Lightning (the public API is ``__all__``)."""
from __future__ import annotations

__version__ = "0.1.0"

from mptrain.callbacks import (AutoFp32Fallback, ChannelsLast, CompileModel, CudaGraphs, Fp32Finetune, FuseModules,
                               OverflowMonitor, ResumeState)
from mptrain.resume import AtomicCheckpointIO, CheckpointError
from mptrain.precision import (PRECISIONS, DynamicLossScaler, Fp8Precision, MasterPrecision, MixedPrecision, NonFiniteError,
                               ShardedPrecision, StochasticRoundingPrecision, TruePrecision)
from mptrain.trainer import Trainer

__all__ = ["PRECISIONS", "AtomicCheckpointIO", "AutoFp32Fallback", "ChannelsLast", "CheckpointError", "CompileModel",
           "CudaGraphs", "DynamicLossScaler", "Fp32Finetune", "Fp8Precision", "FuseModules", "MasterPrecision",
           "MixedPrecision", "NonFiniteError", "OverflowMonitor", "ResumeState", "ShardedPrecision",
           "StochasticRoundingPrecision", "Trainer", "TruePrecision", "__version__"]
