"""The fp32 fallback's cross_entropy on large half logits, a block of rows at a time.

``F.cross_entropy(x.float(), target)`` on half logits ``x`` [N, C] keeps, for backward, the fp32 log-softmax
(twice ``x``'s bytes); in the forward the fp32 upcast exists beside it, and in backward the log-softmax, the
gradient nll_loss hands it and the gradient it hands back are three fp32 copies at once: 6x ``x``'s bytes
(BERT-base's masked-LM head at batch 128 x 128: 16384 x 30522 logits, 1 GB in bf16, 6 GB in that backward).

Here autograd saves ``x`` itself; the forward computes each block's fp32 log-softmax and keeps only the
targets' log-probabilities; backward recomputes each block's log-softmax (the same kernel on the same rows:
bitwise the forward's), runs the kernels autograd would (nll_loss's backward, log_softmax's) on that block and
writes its gradient into the half gradient: ``x`` and its gradient plus one block's three fp32 tensors,
whatever N.  The loss is bitwise ``F.cross_entropy(x.float(), target)``'s (each kernel treats the rows alone, and
nll_loss reads the same log-probabilities in the same order); the gradient is bitwise on the CPU and within
rounding on CUDA, whose softmax backward on a block rounds differently from the whole-tensor kernel.
The price is the recomputed log-softmax: about 7 bytes of memory traffic an element more in backward.

Taken for class-index targets of 2-D logits of at least ``MIN_ELEMENTS`` elements, without class weights or
label smoothing, in eager mode (compiled graphs choose their own fusion); anything else runs the plain path.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mptrain.compat import torch as compat
from mptrain.ops.dtypes import HALF_DTYPES

#: logits smaller than this run the plain path (their memory is small; the blocks cost launches)
MIN_ELEMENTS = 1 << 24
#: a block's rows hold about this many elements: each of its three fp32 tensors is about 64 MB.  Smaller blocks cost
#: more launches (a few us each, against tens of us of memory traffic a block); larger ones raise the peak: at 2^26
#: a small BERT's 4096 x 30522 logits made under two blocks, whose fp32 tensors outweighed the logits themselves
BLOCK_ELEMENTS = 1 << 24
_REDUCTIONS = ("none", "mean", "sum")  # in the order of aten's reduction enum
_F_CROSS_ENTROPY = F.cross_entropy  # before any wrapping


def class_index_call(func, args: tuple, kwargs: dict, dtypes: tuple = HALF_DTYPES) -> Optional[dict]:
    """A ``F.cross_entropy`` call's arguments by name where they are the case the rewrites cover: 2-D logits of
    one of ``dtypes`` (half by default), 1-D class-index targets (one a row), no class weights, no label
    smoothing, no legacy reduction flags; None for anything else (another spelling included)."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    if func is not _F_CROSS_ENTROPY or len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    call = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
            "label_smoothing": 0.0, **dict(zip(names, args)), **kwargs}
    x, target = call.get("input"), call.get("target")
    if not (isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor) and x.dim() == 2
            and x.dtype in dtypes and target.dim() == 1 and not target.is_floating_point()
            and target.shape[0] == x.shape[0]
            and call["weight"] is None and call["size_average"] is None and call["reduce"] is None
            and call["label_smoothing"] == 0.0 and call["reduction"] in _REDUCTIONS
            and isinstance(call["ignore_index"], int)):
        return None
    return call


def lean_cross_entropy(func, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The fp32 loss of a ``F.cross_entropy`` call on half logits by blocks, or None where the plain path
    must run (another spelling, a case the blocks do not cover, compiling)."""
    if compat.is_traced(args[0] if args else kwargs.get("input")):
        return None
    call = class_index_call(func, args, kwargs)
    if call is None or call["input"].numel() < MIN_ELEMENTS:
        return None
    return _BlockCrossEntropy.apply(call["input"], call["target"], call["ignore_index"], call["reduction"])


def _blocks(n: int, c: int):
    rows = max(1, BLOCK_ELEMENTS // c)
    return [(i, min(n, i + rows)) for i in range(0, n, rows)]


class _BlockCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
        n, c = x.shape
        ignored = target == ignore_index
        safe = torch.where(ignored, torch.zeros_like(target), target)  # a valid column on ignored rows too
        picked = torch.empty(n, 1, dtype=torch.float32, device=x.device)
        for a, b in _blocks(n, c):
            picked[a:b] = torch.log_softmax(x[a:b].float(), 1).gather(1, safe[a:b, None])
        # nll_loss over the targets' log-probabilities as a one-class input: the same values in the same order
        # as over the whole log-softmax (its reductions walk the rows, not the classes)
        one_class = torch.where(ignored, target, torch.zeros_like(target))
        enum = _REDUCTIONS.index(reduction)
        loss, total_weight = torch.ops.aten.nll_loss_forward(picked, one_class, None, enum, ignore_index)
        ctx.save_for_backward(x, target, total_weight)
        ctx.ignore_index, ctx.enum = ignore_index, enum
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The kernels autograd runs after the plain forward (nll_loss's backward, log_softmax's), a block of
        rows at a time on that block's recomputed log-softmax: each row's gradient bitwise autograd's."""
        x, target, total_weight = ctx.saved_tensors
        n, c = x.shape
        gx = torch.empty_like(x)
        for a, b in _blocks(n, c):
            logp = torch.log_softmax(x[a:b].float(), 1)
            g = torch.ops.aten.nll_loss_backward(grad if grad.dim() == 0 else grad[a:b], logp, target[a:b], None,
                                                 ctx.enum, ctx.ignore_index, total_weight)
            gx[a:b] = compat.log_softmax_backward(g, logp, 1, torch.float32)
            del logp, g  # before the next block's are made: one block's fp32 tensors at a time, not two
        return gx, None, None, None
