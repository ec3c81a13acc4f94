"""Drop-in modules: FusedLayerNorm, FusedRMSNorm, FusedScaleMaskSoftmax, FusedLSTMCell, FusedLSTM,
FusedMaxPool2d, PaddedLinear, and fuse_modules(model) to swap them into a model."""
from mptrain.nn.fuse import fuse_modules
from mptrain.nn.linear import PaddedLinear
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm
from mptrain.nn.pool import FusedMaxPool2d
from mptrain.nn.softmax import FusedScaleMaskSoftmax

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedScaleMaskSoftmax", "FusedLSTMCell", "FusedLSTM", "FusedMaxPool2d",
           "PaddedLinear", "fuse_modules"]
