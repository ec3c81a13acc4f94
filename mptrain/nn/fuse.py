"""fuse_modules(model): swap torch modules for their fused drop-ins, in place.

nn.LayerNorm -> FusedLayerNorm, nn.RMSNorm -> FusedRMSNorm, nn.LSTMCell -> FusedLSTMCell
and nn.LSTM -> FusedLSTM (unidirectional, no projections; others are left alone).  The
new modules share the old ones' Parameter objects, so an optimizer built before the swap
keeps working and the model's output is unchanged.  Only exact torch classes are swapped
(subclasses may override forward and are left as they are).
"""
from __future__ import annotations

from torch import nn

from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm


def _replacements():
    """(torch class, factory) pairs; the LSTM ones only when mptrain.nn.lstm imports."""
    pairs = [(nn.LayerNorm, FusedLayerNorm.from_module), (nn.RMSNorm, FusedRMSNorm.from_module)]
    try:
        from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
    except ImportError:
        return pairs

    def lstm(m):
        return FusedLSTM.from_module(m) if not m.bidirectional and m.proj_size == 0 else None

    return pairs + [(nn.LSTMCell, FusedLSTMCell.from_module), (nn.LSTM, lstm)]


def _replacement(module, pairs):
    for cls, make in pairs:
        if type(module) is cls:
            return make(module)
    return None


def fuse_modules(model: nn.Module) -> nn.Module:
    """Swap supported submodules of ``model`` for fused ones in place; returns ``model``.

    When ``model`` itself is a supported module it cannot be swapped in place: the fused
    replacement is returned instead (so always use the return value).
    """
    pairs = _replacements()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child, pairs)
            if new is not None:
                setattr(parent, name, new)
    top = _replacement(model, pairs)
    return model if top is None else top
