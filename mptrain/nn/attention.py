"""Attention with the fused scaled masked softmax, as a transformers attention function:
``register_transformers_attention()`` adds it to transformers' ``AttentionInterface`` under
``"mptrain_fused_softmax"``; a model built with that ``attn_implementation`` (e.g. by
``mptrain.models.bert.build_bert_mlm``) then runs one ``torch.ops.mptrain.scaled_masked_softmax``
instead of eager attention's scale, mask add and ``F.softmax`` (three passes over the scores).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mptrain import ops

ATTENTION_NAME = "mptrain_fused_softmax"


def _bool_mask(attention_mask):
    """True = masked out. transformers passes boolean masks with True = attend (SDPA's
    convention) or additive float masks (0 = attend, a large negative value = masked)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask
    return attention_mask != 0


def fused_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention with the fused softmax: (B, heads, S, D) in, (B, S, heads, D) out."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3))
    probs = ops.scaled_masked_softmax(scores, _bool_mask(attention_mask), scaling, getattr(module, "is_causal", False)
                                      and attention_mask is None)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register_transformers_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`fused_softmax_attention` with transformers under ``name``; returns ``name``."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("the fused attention function needs transformers >= 4.48: pip install 'mptrain[nlp]'") from e
    AttentionInterface.register(name, fused_softmax_attention)
    return name
