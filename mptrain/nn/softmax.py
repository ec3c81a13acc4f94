"""FusedScaleMaskSoftmax: attention-score softmax with scale, boolean mask and causal
masking in one fused kernel (mptrain.ops.scaled_masked_softmax)."""
from __future__ import annotations

from torch import nn

from mptrain import ops
from mptrain.ops.dispatch import check_fused


class FusedScaleMaskSoftmax(nn.Module):
    """``softmax(masked_fill(scale * scores, mask | causal, -inf), dim=-1)`` in fp32, in the scores' dtype;
    ``forward(scores, mask=None)`` as :func:`mptrain.ops.scaled_masked_softmax`. No parameters."""

    def __init__(self, scale: float = 1.0, causal: bool = False, *, fused="auto"):
        super().__init__()
        self.scale = float(scale)
        self.causal = bool(causal)
        self.fused = check_fused("FusedScaleMaskSoftmax", fused)

    def forward(self, scores, mask=None):
        return ops.scaled_masked_softmax(scores, mask, self.scale, self.causal, fused=self.fused)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}, fused={self.fused!r}"
