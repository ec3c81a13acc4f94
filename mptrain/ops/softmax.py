"""Scaled masked softmax: ``torch.ops.mptrain.scaled_masked_softmax`` or the reference, as
:mod:`mptrain.ops.dispatch` decides. Backward reads only the saved output.
"""
from __future__ import annotations

from . import reference
from .dispatch import use_op
from .library import OPS

_softmax = OPS["scaled_masked_softmax"]


def scaled_masked_softmax(x, mask=None, scale=1.0, causal=False, *, fused="auto"):
    """Softmax over the last dim of ``scale * x`` with masked positions removed, in fp32.

    ``mask``: bool, broadcastable to ``x`` (True = masked out), e.g. [B, 1, Sq, Sk] or [B, 1, 1, Sk] for
    [B, heads, Sq, Sk] scores. ``causal=True`` also masks key k > query q (top-left aligned, as
    ``scaled_dot_product_attention(is_causal=True)``). Fully masked rows give zeros, not NaN."""
    if not use_op("scaled_masked_softmax", x, fused):
        return reference.scaled_masked_softmax(x, mask, scale, causal)
    return _softmax(x, mask, scale, causal)
