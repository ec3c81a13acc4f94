"""Optional use of mptrain.nn's fused layers: the models work (with one warning) while
mptrain.nn is absent or cannot build its kernels."""
from __future__ import annotations

import warnings

from torch import nn


def fuse(model: nn.Module, enabled: bool = True) -> nn.Module:
    """``mptrain.nn.fuse_modules(model)`` (LayerNorm -> FusedLayerNorm, ...) when available."""
    if not enabled:
        return model
    try:
        from mptrain.nn import fuse_modules
    except ImportError as e:
        warnings.warn(f"mptrain.nn.fuse_modules is unavailable ({e}); keeping PyTorch's LayerNorm", stacklevel=2)
        return model
    out = fuse_modules(model)
    return model if out is None else out


def lstm(input_size: int, hidden_size: int, num_layers: int, dropout: float, fused: bool = True) -> nn.Module:
    """``mptrain.nn.FusedLSTM`` (batch-first, nn.LSTM's interface) or ``torch.nn.LSTM``."""
    kwargs = dict(num_layers=num_layers, batch_first=True, dropout=dropout if num_layers > 1 else 0.0)
    if fused:
        try:
            from mptrain.nn import FusedLSTM
        except ImportError as e:
            warnings.warn(f"mptrain.nn.FusedLSTM is unavailable ({e}); using torch.nn.LSTM", stacklevel=2)
        else:
            return FusedLSTM(input_size, hidden_size, **kwargs)
    return nn.LSTM(input_size, hidden_size, **kwargs)
