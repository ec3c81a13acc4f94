"""fuse_modules(model): swap nn.LayerNorm, nn.RMSNorm, nn.LSTMCell, nn.LSTM (unidirectional, no
projections) and nn.MaxPool2d (dilation 1, floor mode, no indices) for their fused drop-ins, and a large
nn.Linear with a ragged output width (a vocabulary projection) for PaddedLinear, in place.
The new modules share the old ones' Parameter objects (an optimizer built before keeps working; the
output is unchanged, up to the rounding of the GEMM kernel a PaddedLinear gets on CUDA). Only exact torch
classes are swapped: subclasses may override forward.
"""
from __future__ import annotations

from torch import nn

from mptrain.nn.linear import PaddedLinear
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm
from mptrain.nn.pool import FusedMaxPool2d


def _lstm(m: nn.LSTM):
    return FusedLSTM.from_module(m) if not m.bidirectional and m.proj_size == 0 else None


def _linear(m: nn.Linear):
    return PaddedLinear.from_module(m) if PaddedLinear.worth_padding(m) else None


#: exact torch class -> the factory of its drop-in (None: left as it is)
_REPLACEMENTS = {nn.LayerNorm: FusedLayerNorm.from_module, nn.RMSNorm: FusedRMSNorm.from_module,
                 nn.LSTMCell: FusedLSTMCell.from_module, nn.LSTM: _lstm, nn.MaxPool2d: FusedMaxPool2d.from_module,
                 nn.Linear: _linear}


def _replacement(module):
    return _REPLACEMENTS.get(type(module), lambda m: None)(module)


def fuse_modules(model: nn.Module) -> nn.Module:
    """Swap supported submodules of ``model`` for fused ones in place; returns ``model``, or the fused
    replacement when ``model`` itself is a supported module (so always use the return value)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child)
            if new is not None:
                setattr(parent, name, new)
    top = _replacement(model)
    return model if top is None else top
