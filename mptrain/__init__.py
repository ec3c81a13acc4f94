"""mptrain: mixed-precision training for PyTorch inside Lightning.

Public API: :class:`Trainer` (a ``lightning.pytorch.Trainer``), the precision plugins
(:class:`MasterPrecision`, :class:`MixedPrecision`, :class:`TruePrecision`,
:class:`ShardedPrecision` for ``strategy="fsdp"``),
:class:`DynamicLossScaler`, :class:`NonFiniteError`, :data:`PRECISIONS`, the checkpoint
plugin :class:`AtomicCheckpointIO` with :class:`CheckpointError`, and the callbacks.
"""
from __future__ import annotations

__version__ = "0.1.0"

from mptrain.callbacks import (
    AutoFp32Fallback,
    ChannelsLast,
    CompileModel,
    CudaGraphs,
    Fp32Finetune,
    OverflowMonitor,
    ResumeState,
)
from mptrain.checkpoint import AtomicCheckpointIO, CheckpointError
from mptrain.precision import (
    PRECISIONS,
    DynamicLossScaler,
    MasterPrecision,
    MixedPrecision,
    NonFiniteError,
    ShardedPrecision,
    TruePrecision,
)
from mptrain.trainer import Trainer

__all__ = [
    "PRECISIONS",
    "AtomicCheckpointIO",
    "AutoFp32Fallback",
    "ChannelsLast",
    "CheckpointError",
    "CompileModel",
    "CudaGraphs",
    "DynamicLossScaler",
    "Fp32Finetune",
    "MasterPrecision",
    "MixedPrecision",
    "NonFiniteError",
    "OverflowMonitor",
    "ResumeState",
    "ShardedPrecision",
    "Trainer",
    "TruePrecision",
    "__version__",
]
