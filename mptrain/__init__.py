"""mptrain: mixed-precision training for PyTorch.

Public API: :class:`Trainer`, :class:`DynamicLossScaler`, :data:`PRECISIONS`,
:class:`NonFiniteError`.
"""
from __future__ import annotations

__version__ = "0.1.0"

from mptrain.callbacks import Callback
from mptrain.checkpoint import CheckpointError
from mptrain.precision import PRECISIONS, build_precision
from mptrain.precision.loss_scaler import DynamicLossScaler, NonFiniteError
from mptrain.trainer import Trainer

__all__ = [
    "PRECISIONS",
    "Callback",
    "CheckpointError",
    "DynamicLossScaler",
    "NonFiniteError",
    "Trainer",
    "__version__",
    "build_precision",
]
