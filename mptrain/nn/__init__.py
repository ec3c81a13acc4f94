"""Fused drop-in modules: FusedLayerNorm, FusedRMSNorm, FusedScaleMaskSoftmax,
FusedLSTMCell, FusedLSTM, and fuse_modules(model) to swap them into a model."""
from mptrain.nn.fuse import fuse_modules
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm
from mptrain.nn.softmax import FusedScaleMaskSoftmax

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedScaleMaskSoftmax", "FusedLSTMCell", "FusedLSTM", "fuse_modules"]
