"""Drop-in normalization modules backed by the fused kernels (mptrain.ops.layer_norm).

``FusedLayerNorm`` / ``FusedRMSNorm`` subclass ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``: same
arguments, parameter names, state_dict keys and initialisation, so checkpoints move freely between them.
"""
from __future__ import annotations

from torch import nn

from mptrain import ops
from mptrain.ops.dispatch import check_fused


class FusedLayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm with the fused LayerNorm kernel on CUDA; ``fused``: "auto" (the kernel on CUDA
    when the extension loads, else the reference), True (require the kernel), False (always the reference)."""

    fused = "auto"  # class default, so a module whose class was swapped in place has it
    # Half input with fp32 weight (the *-master case) is native: fp32 statistics inside, input
    # dtype out; the precision's fp32 module policy need not upcast the activation.
    accepts_mixed_dtypes = True

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None,
                 *, fused="auto"):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.fused = check_fused("FusedLayerNorm", fused)

    @classmethod
    def from_module(cls, ln: nn.LayerNorm, **kwargs) -> "FusedLayerNorm":
        """A FusedLayerNorm sharing ``ln``'s Parameter objects (optimizers keep working)."""
        new = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None, device="meta", **kwargs)
        new.weight, new.bias = ln.weight, ln.bias
        return new.train(ln.training)

    def forward(self, input):
        return ops.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, fused=self.fused)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused={self.fused!r}"


class FusedRMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm with the fused RMSNorm kernel on CUDA (``fused`` as FusedLayerNorm)."""

    fused = "auto"
    accepts_mixed_dtypes = True  # as FusedLayerNorm

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None,
                 *, fused="auto"):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.fused = check_fused("FusedRMSNorm", fused)

    @classmethod
    def from_module(cls, rms: nn.RMSNorm, **kwargs) -> "FusedRMSNorm":
        """A FusedRMSNorm sharing ``rms``'s Parameter objects (optimizers keep working)."""
        new = cls(rms.normalized_shape, rms.eps, rms.elementwise_affine, device="meta", **kwargs)
        new.weight = rms.weight
        return new.train(rms.training)

    def forward(self, x):
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps, fused=self.fused)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused={self.fused!r}"
