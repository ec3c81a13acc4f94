"""Memory layouts the multi-tensor kernels can walk.

The kernels treat a param, its grad and its state buffers as one flat array each, so all must be
dense (no gaps, no overlap) with the same strides. Others (a sliced param, a transposed or expanded
grad) are stepped through dense working copies, the param copy written back after the update.
"""
from __future__ import annotations

import torch

from mptrain.ops.multi_tensor import is_dense  # the kernels' own layout rule


def state_in_layout(value: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of a loaded state tensor (any layout, device, dtype) in ``p``'s working layout (``p``'s
    strides when ``p`` is dense, else contiguous: what ``empty_like(preserve_format)`` gives)."""
    if value.shape != p.shape:
        raise ValueError(f"optimizer state of shape {tuple(value.shape)} for a param of shape {tuple(p.shape)}; "
                         "the state_dict belongs to a different model")
    return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(value.detach())


def dense_work_lists(params: list, grads: list) -> tuple[list, list, list]:
    """(params, grads, write_back) the kernels can walk: non-dense params replaced by
    contiguous copies (``write_back`` lists the (param, copy) pairs to copy back after the
    update), grads whose layout differs from their (working) param copied into it."""
    work_p, work_g, write_back = params, grads, []
    for i, (p, g) in enumerate(zip(params, grads)):
        if g.stride() == p.stride() and p.is_contiguous():  # the usual case, checked cheaply
            continue
        w = p
        if not is_dense(p):
            w = p.contiguous()
            write_back.append((p, w))
        if w.stride() != g.stride() or not is_dense(g):
            g = torch.empty_like(w, dtype=g.dtype).copy_(g)
        if w is not p or g is not grads[i]:
            if work_p is params:  # copy the lists only when something changes
                work_p, work_g = list(params), list(grads)
            work_p[i], work_g[i] = w, g
    return work_p, work_g, write_back
