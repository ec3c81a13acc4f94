"""The fp32 fallback's cross_entropy on half logits while ``torch.compile`` traces: ``logsumexp - picked logit``.

``F.cross_entropy(x.float(), target)`` traced whole materializes the fp32 log-softmax for backward, and inductor
fused its backward with the upcast into one pointwise kernel that took 11.8 ms of a 54 ms compiled BERT-base
step on an H100 (16384 x 30522 logits; with the fallback off, the loss's backward kernel took 1.2 ms).  Written as
``logsumexp(x.float()) - x.float()[target]``, the graph holds one reduction over the half logits in forward and
one pointwise pass in backward (``softmax - one-hot``, computed in fp32 and written in the logits' dtype),
and saves only the half logits and the rows' logsumexp: fp32 compute throughout, the same loss up to the
rounding of the reduction order.

Taken for class-index targets of 2-D half logits, without class weights or label smoothing; anything else
traces the plain ``F.cross_entropy`` on fp32 copies.

**Outside the compiled model.** ``compile=True`` compiles the LightningModule's ``model``; a loss the
``training_step`` computes on the model's output runs eagerly, and there ``F.cross_entropy(logits.float(), y)``
on a causal LM's 16384 x 32000 logits keeps the 2.1 GB fp32 log-softmax for backward and, in backward, holds it
beside two more fp32 tensors of its size (nll_loss's gradient and log_softmax's).  When the run compiles
(:meth:`Fp32Fallback.compile_losses`), the fallback runs large logits' losses (``MIN_ELEMENTS`` and up, half or
fp32) through this same form compiled on its own: it keeps the logits and a value a row, and backward writes
the gradient in one pass.  Not the user's ``training_step``: compiling user code around the model would
recompile it for every value of a Python int it reads (``self.global_step``); this function reads none.
"""
from __future__ import annotations

from typing import Optional

import torch

from mptrain.compat import torch as compat
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision.lean_cross_entropy import MIN_ELEMENTS, class_index_call


def compiled_cross_entropy(func, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The fp32 loss of a ``F.cross_entropy`` call on half logits as traced code, or None where the plain path
    must run (eager mode, another spelling, a case this form does not cover)."""
    if not compat.is_traced(args[0] if args else kwargs.get("input")):
        return None
    call = class_index_call(func, args, kwargs)
    if call is None:
        return None
    return cross_entropy_rows(call["input"], call["target"], call["ignore_index"], call["reduction"])


def eager_compiled_cross_entropy(func, args: tuple, kwargs: dict, compile_kwargs: dict) -> Optional[torch.Tensor]:
    """In eager code of a compiling run: the fp32 loss of a ``F.cross_entropy`` call on large half or fp32
    logits through :func:`cross_entropy_rows` compiled with ``compile_kwargs``; None for small logits (a compile
    for what costs little), traced code (:func:`compiled_cross_entropy` has it) and uncovered cases."""
    x = args[0] if args else kwargs.get("input")
    if compat.is_traced(x):
        return None
    call = class_index_call(func, args, kwargs, dtypes=HALF_DTYPES + (torch.float32,))
    if call is None or call["input"].numel() < MIN_ELEMENTS:
        return None
    fn = _compiled_rows(compile_kwargs)
    return fn(call["input"], call["target"], call["ignore_index"], call["reduction"])


_COMPILED: dict = {}  # repr of the torch.compile arguments -> cross_entropy_rows compiled with them


def _compiled_rows(compile_kwargs: dict):
    """:func:`cross_entropy_rows` compiled once per set of ``torch.compile`` arguments (``options`` is a dict: the
    arguments' repr is the key)."""
    key = repr(sorted(compile_kwargs.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(cross_entropy_rows, **compile_kwargs)
    return _COMPILED[key]


def cross_entropy_rows(x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """``F.cross_entropy(x.float(), target, ignore_index=..., reduction=...)`` as ``logsumexp - target logit``:
    code to trace (module docstring)."""
    ignored = target == ignore_index
    safe = torch.where(ignored, torch.zeros_like(target), target)
    xf = x.float()
    # the target's logit as a masked row sum (exact: one term), not a gather: inductor fuses it into the
    # logsumexp's pass over the row, and its backward into the softmax's pointwise pass, where a gather's
    # backward would scatter into a whole zero tensor of the logits' size
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    rows = torch.logsumexp(xf, 1) - torch.where(hit, xf, torch.zeros_like(xf)).sum(1)
    rows = torch.where(ignored, torch.zeros_like(rows), rows)
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (~ignored).sum()  # nll_loss's mean: over the rows not ignored (all ignored: nan, as torch)
