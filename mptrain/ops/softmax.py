"""Scaled masked softmax op: an autograd function over csrc/softmax.cu and the dispatch
between it and the pure-PyTorch reference in :mod:`mptrain.ops.reference`.

``y = softmax(masked_fill(scale * x, mask | causal, -inf), dim=-1)`` in fp32, output in
``x``'s dtype; a fully masked row gives zeros. Backward reads only the saved output.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import reference
from .layer_norm import kernel_extension


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale, causal, ext):
        y = ext.scaled_masked_softmax_forward(x.contiguous(), mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale, ctx.ext = scale, ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dx = ctx.ext.scaled_masked_softmax_backward(dy.contiguous(), y, ctx.scale)
        return dx, None, None, None, None


def scaled_masked_softmax(x, mask=None, scale=1.0, causal=False, *, fused="auto"):
    """Softmax over the last dim of ``scale * x`` with masked positions removed.

    ``mask``: bool, broadcastable to ``x`` (True = masked out), e.g. [B, 1, Sq, Sk] or
    [B, 1, 1, Sk] for [B, heads, Sq, Sk] scores; it is read through its broadcast strides.
    ``causal=True`` also masks key k > query q (top-left aligned, as
    ``scaled_dot_product_attention(is_causal=True)``). Fully masked rows give zeros.
    """
    reference.softmax_mask(x, mask, False)  # argument checks with clear messages
    if causal and x.dim() < 2:
        raise ValueError(f"causal=True needs an input with at least 2 dims (..., queries, keys), got {list(x.shape)}")
    ext = kernel_extension("scaled_masked_softmax", x, (mask,), fused)
    if ext is None:
        return reference.scaled_masked_softmax(x, mask, scale, causal)
    return _SoftmaxFunction.apply(x, mask, float(scale), bool(causal), ext)
