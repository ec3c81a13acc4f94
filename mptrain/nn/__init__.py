"""Fused drop-in modules: FusedLayerNorm, FusedRMSNorm, FusedScaleMaskSoftmax,
FusedLSTMCell, FusedLSTM, FusedMaxPool2d, and fuse_modules(model) to swap them into a model."""
from mptrain.nn.fuse import fuse_modules
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm
from mptrain.nn.pool import FusedMaxPool2d
from mptrain.nn.softmax import FusedScaleMaskSoftmax

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedScaleMaskSoftmax", "FusedLSTMCell", "FusedLSTM", "FusedMaxPool2d",
           "fuse_modules"]
