"""FusedMaxPool2d: nn.MaxPool2d on :func:`mptrain.ops.max_pool2d` (csrc/max_pool.cu for channels_last
CUDA input)."""
from __future__ import annotations

from torch import nn

from mptrain.ops import max_pool2d
from mptrain.ops.dispatch import check_fused
from mptrain.ops.pool import MAX_WINDOW, as_pair


class FusedMaxPool2d(nn.MaxPool2d):
    """Drop-in for ``nn.MaxPool2d`` (same arguments, same results).  The fused kernel takes dilation 1,
    floor mode, no returned indices and windows of at most 127 elements; other configurations run torch's
    pool under ``fused="auto"`` and raise here under ``fused=True``."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False, *,
                 fused="auto"):
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self.fused = check_fused("FusedMaxPool2d", fused)
        why = self.unsupported()
        if why and fused is True:
            raise ValueError(f"FusedMaxPool2d(fused=True): the kernel does not take {why}; use fused='auto' "
                             "(torch's pool for this configuration) or nn.MaxPool2d")

    def unsupported(self) -> str:
        """What of this configuration the kernel cannot take ('' when it takes it all)."""
        k = as_pair(self.kernel_size)
        bad = (as_pair(self.dilation) != (1, 1), self.ceil_mode, self.return_indices, k[0] * k[1] > MAX_WINDOW)
        if not any(bad):  # forward asks on every call: no message strings built for the common case
            return ""
        whys = (f"dilation={self.dilation}", "ceil_mode=True", "return_indices=True",
                f"kernel_size={self.kernel_size} (more than {MAX_WINDOW} elements)")
        return ", ".join(why for b, why in zip(bad, whys) if b)

    @classmethod
    def from_module(cls, m: nn.MaxPool2d, fused="auto") -> "FusedMaxPool2d | None":
        """The fused drop-in for ``m``, or None when the kernel cannot take its configuration."""
        new = cls(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode, fused="auto")
        new.fused = check_fused("FusedMaxPool2d", fused)
        new.train(m.training)
        return None if new.unsupported() else new

    def forward(self, x):
        if self.unsupported():
            return super().forward(x)
        return max_pool2d(x, self.kernel_size, self.stride, self.padding, fused=self.fused)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused={self.fused!r}"
