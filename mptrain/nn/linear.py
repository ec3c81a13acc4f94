"""PaddedLinear: nn.Linear whose fp16 / bf16 CUDA GEMMs run with the output width padded to a multiple of 64.

A vocabulary projection is the usual case: BERT's 30522 outputs, GPT-2's 50257.  With an output width
that is not a multiple of 8, the output, its gradient and the weight read in its other orientation
have a row stride that is not 16-byte aligned in 16-bit storage, and cuBLAS cannot use its fastest
tensor-core kernels.  On the H200 (`python3 dev/ragged_linear.py`, forward + backward, GPU time), the
BERT MLM decoder (2560 x 768 x 30522) took 1.59 ms eager, the GPT-2 head (8192 x 768 x 50257)
16.0 ms, against 0.65 ms for the aligned 30528; padded as below, 1.06 and 5.17 ms.  A whole GPT-2 small
training step (bf16, 8 x 1024 tokens, eager) went from 44.5 to 33.6 ms (`dev/ragged_linear.py --gpt2`).

Padding is done at every call: the weight (and bias) are zero-padded, the GEMM runs at the padded
width, and the output is sliced back and made contiguous (a drop-in must not hand back a strided view
where nn.Linear returned a contiguous tensor; compiled code can fuse the copy into its consumer).  The
parameters keep their shapes, so state_dicts, weight tying, optimizers and sharding see nn.Linear's.
The padded rows are zero and get no gradient back (autograd slices their part of the weight
gradient away); the outputs are the same dot products, rounded by whichever cuBLAS kernel runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.nn.retype import retype
from mptrain.ops.dtypes import HALF_DTYPES


class PaddedLinear(nn.Linear):
    """Drop-in for ``nn.Linear`` (same parameters, state_dict and results up to GEMM rounding) that pads its
    output width to a multiple of ``MULTIPLE`` for fp16 / bf16 GEMMs on CUDA (autocast included); every other
    call is ``nn.Linear``'s.  :meth:`worth_padding` says which layers ``fuse_modules`` swaps."""

    MULTIPLE = 64
    #: Smaller layers are left as they are: their GEMMs are cheap, and the pad and the copy back add launches
    #: to what may be a host-bound step (measured only at vocabulary sizes: 23M and 39M weights).
    MIN_WEIGHT_NUMEL = 2**20

    @classmethod
    def worth_padding(cls, linear: nn.Module) -> bool:
        """An exact ``nn.Linear`` with a ragged output width (not a multiple of 8), an aligned input width
        (padding the output alone cannot align the input) and at least ``MIN_WEIGHT_NUMEL`` weights."""
        return (type(linear) is nn.Linear and linear.out_features % 8 != 0 and linear.in_features % 8 == 0
                and linear.out_features * linear.in_features >= cls.MIN_WEIGHT_NUMEL)

    @classmethod
    def from_module(cls, linear: nn.Linear) -> "PaddedLinear":
        """``linear`` itself with its class changed: parameters (tied ones too), hooks and settings stay."""
        return retype(linear, nn.Linear, cls, "PaddedLinear.from_module")

    def pads(self, x: torch.Tensor) -> bool:
        """Whether this call's GEMM runs padded: a ragged width and a 16-bit GEMM on CUDA."""
        if self.out_features % 8 == 0 or not x.is_cuda:
            return False
        if torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda") in HALF_DTYPES
        return x.dtype in HALF_DTYPES and self.weight.dtype == x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pads(x):
            return F.linear(x, self.weight, self.bias)
        extra = -self.out_features % self.MULTIPLE
        weight = F.pad(self.weight, (0, 0, 0, extra))
        bias = None if self.bias is None else F.pad(self.bias, (0, extra))
        return F.linear(x, weight, bias)[..., : self.out_features].contiguous()
