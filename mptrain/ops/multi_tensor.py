"""Multi-tensor ops: one kernel launch for a whole list of tensors (csrc/multi_tensor_*.cu).

Each function takes lists (one tensor per parameter) and a ``fused`` switch (see
:mod:`mptrain.ops.dispatch`). Scalars that change every step (``lr``, ``grad_scale``) may be
1-element float32 tensors on the device; ``found_inf`` always is. Nothing here syncs with the
host on the kernel path, so every op can be captured in a CUDA graph.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence, Union

import torch

from . import reference
from .reference import is_dense  # the kernels' layout rule (csrc checks it), shared with the references
from .dispatch import KERNEL_DTYPES, use_op
from .library import OPS

Scalar = Union[float, torch.Tensor]


def _use_op(op: str, tensors: Sequence[torch.Tensor], fused) -> bool:
    """Whether to run ``torch.ops.mptrain.<op>`` on these (non-empty) tensors, else the reference."""
    # Lists reach here split by dtype (src first, dst last): checking both ends covers
    # every dtype in the call; the C++ side checks every tensor and names a stray one.
    last = tensors[-1]
    return use_op(op, last if last.is_cuda and last.dtype not in KERNEL_DTYPES else tensors[0], fused)


def _device_scalar(value: Optional[Scalar], device: torch.device, what: str, op: str) -> Optional[torch.Tensor]:
    """A 1-element float32 tensor on ``device`` (or None)."""
    if value is None:
        return None
    if not torch.is_tensor(value):
        return torch.full((), float(value), dtype=torch.float32, device=device)
    if value.numel() != 1:
        raise ValueError(f"{op}: {what} must hold one value, got shape {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.float32).reshape(())


def _check_found_inf(found_inf: Optional[torch.Tensor], device: torch.device, op: str) -> None:
    if found_inf is None:
        return
    if not torch.is_tensor(found_inf) or found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise TypeError(f"{op}: found_inf must be a float32 tensor with one element (it is written in place), "
                        f"got {found_inf!r:.80}")
    if found_inf.device != device:
        raise ValueError(f"{op}: found_inf is on {found_inf.device} but the tensors are on {device}; "
                         "create it on the tensors' device")


def _groups(*lists: Sequence[torch.Tensor]) -> dict:
    """Indices grouped by (device, dtype of each list's tensor): one kernel call per group."""
    first = lists[0][0]
    # Fast path for the usual case, one CUDA device and one dtype per list: sets cost a fraction of a key
    # per tensor, which matters for 400-tensor lists stepped every iteration (the host must stay ahead).
    if first.is_cuda and len({t.get_device() for t in lists[0]}) == 1 and all(
            len({t.dtype for t in lst}) == 1 for lst in lists):
        return {(first.device,) + tuple(lst[0].dtype for lst in lists): range(len(lists[0]))}
    out: dict = defaultdict(list)
    for i in range(len(lists[0])):
        out[(lists[0][i].device,) + tuple(lst[i].dtype for lst in lists)].append(i)
    return out


def _pick(lst: list, idx) -> list:
    return lst if len(idx) == len(lst) else [lst[i] for i in idx]


def _same_list(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> bool:
    """Whether the call is in place (``dst`` is ``src``).  Under dynamo, tensor by tensor: torch 2.6's
    dynamo evaluates ``list_a is list_b`` by comparing the tensors' values (a graph break)."""
    if torch.compiler.is_compiling():
        return len(dst) == len(src) and all(d is s for d, s in zip(dst, src))
    return dst is src


def _split_walkable(src: list, dst: list, in_place: bool) -> tuple[list, list, list, list]:
    """``(src, dst)`` the kernel can walk and the rest ``(src, dst)``, for the per-tensor reference: a tensor that is
    not dense, or a (src, dst) pair whose strides differ (the kernel walks both flat, element i with element i).
    ``dst`` empty (check only) or ``src`` itself (``in_place``) is split along.  The usual lists (dense, same strides)
    come back as they are."""
    # is_contiguous() first, inline: the usual lists cost one C call per tensor (the host must stay ahead). Two
    # contiguous tensors of one shape have the same strides; of different shapes they are the caller's mistake,
    # which the kernel's own check names.
    if dst and not in_place:
        ok = [(a.is_contiguous() and b.is_contiguous()) or (a.stride() == b.stride() and is_dense(a) and is_dense(b))
              for a, b in zip(src, dst)]
    else:
        ok = [t.is_contiguous() or is_dense(t) for t in src]
    if all(ok):
        return src, dst, [], []
    walk_s = [t for t, keep in zip(src, ok) if keep]
    rest_s = [t for t, keep in zip(src, ok) if not keep]
    if not dst or in_place:
        return walk_s, (walk_s if dst else []), rest_s, (rest_s if dst else [])
    return walk_s, [t for t, keep in zip(dst, ok) if keep], rest_s, [t for t, keep in zip(dst, ok) if not keep]


def multi_tensor_scale_(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], scale: Optional[Scalar],
                        found_inf: Optional[torch.Tensor] = None, *, fused="auto") -> None:
    """``dst[i] = src[i] * scale`` (any fp32/fp16/bf16 mix), and ``found_inf = 1`` if any
    ``src`` element is inf or NaN. ``scale=None`` copies. Empty ``dst`` only checks.  Any layout: the
    kernel takes the dense tensors, the reference the others (a slice, a transposed grad copied into a
    contiguous one), both on the device."""
    in_place = _same_list(src, dst)
    src = list(src)
    dst = src if in_place else list(dst)
    if dst and len(dst) != len(src):
        raise ValueError(f"multi_tensor_scale_: {len(src)} sources but {len(dst)} destinations")
    if not src:
        return
    for key, idx in _groups(src, *([dst] if dst and not in_place else [])).items():  # in place: dst is src
        s = _pick(src, idx)
        d = (s if in_place else _pick(dst, idx)) if dst else []
        device = key[0]
        _check_found_inf(found_inf, device, "multi_tensor_scale_")
        sc = _device_scalar(scale, device, "scale", "multi_tensor_scale_")
        if not _use_op("multi_tensor_scale_", s + d, fused):
            reference.multi_tensor_scale(s, d, sc, found_inf)
            continue
        s, d, rest_s, rest_d = _split_walkable(s, d, in_place)
        if rest_s:  # in place without a scale: only the check, as below
            reference.multi_tensor_scale(rest_s, [] if in_place and sc is None else rest_d, sc, found_inf)
        if not s:
            continue
        if not d or (in_place and sc is None):  # nothing to write: only the check
            if found_inf is not None:
                OPS["multi_tensor_check_finite_"](s, found_inf)
        elif in_place:
            OPS["multi_tensor_unscale_"](s, sc, found_inf)
        else:
            OPS["multi_tensor_scale_"](s, d, sc, found_inf)


def multi_tensor_unscale_(grads: Sequence[torch.Tensor], inv_scale: Scalar, found_inf: torch.Tensor, *,
                          fused="auto") -> None:
    """In place ``g *= inv_scale`` for every grad (fp32, fp16 **and bf16**; any layout, a slice or a transposed view
    included), and ``found_inf = 1`` if any grad held an inf or NaN: torch's
    ``_amp_foreach_non_finite_check_and_unscale_``, one kernel launch per dtype for the dense grads."""
    multi_tensor_scale_(grads, grads, inv_scale, found_inf, fused=fused)


def multi_tensor_check_finite_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, *, fused="auto") -> None:
    """``found_inf = 1`` if any element of any tensor is inf or NaN (read-only pass)."""
    multi_tensor_scale_(tensors, [], None, found_inf, fused=fused)


def multi_tensor_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, fused="auto") -> None:
    """``dst[i].copy_(src[i])`` for the whole list in one launch per dtype pair (the
    master-weight path's grads-up / params-down copies); pairs of other layouts (a transposed grad into a
    contiguous master grad, a slice) are copied one by one."""
    multi_tensor_scale_(src, dst, None, None, fused=fused)


def multi_tensor_l2norm(tensors: Sequence[torch.Tensor], per_tensor: bool = False, *, fused="auto"):
    """The L2 norm of all tensors together, a 0-dim float32 tensor on their device; with ``per_tensor=True`` also each
    tensor's norm (float32 [n]): ``(total, norms)``. Deterministic (no atomics). Squares are summed in fp32 within
    chunks of a few thousand elements and in float64 across them. A tensor the kernel cannot walk flat (a slice) is
    read through a dense copy."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("multi_tensor_l2norm: got an empty list; pass at least one tensor")
    device = tensors[0].device
    groups = _groups(tensors)
    if len(groups) == 1:  # the common case: no host-side regrouping
        total, norms = _l2norm(tensors, per_tensor, fused)
        return (total, norms) if per_tensor else total
    sq_parts, per = [], [None] * len(tensors)
    for key, idx in groups.items():
        if key[0] != device:
            raise ValueError(f"multi_tensor_l2norm: tensors on {device} and {key[0]}; pass one device at a time")
        total, norms = _l2norm([tensors[i] for i in idx], per_tensor, fused)
        sq_parts.append(total.double() ** 2)
        if per_tensor:
            for j, i in enumerate(idx):  # views, gathered by one stack below: no host-to-device copy
                per[i] = norms[j]
    total = torch.stack(sq_parts).sum().sqrt().float()  # several groups: the one-group case returned above
    return (total, torch.stack(per)) if per_tensor else total


def _l2norm(tensors, per_tensor, fused):
    if not _use_op("multi_tensor_l2norm", tensors, fused):
        return reference.multi_tensor_l2norm(tensors, per_tensor)
    # A read-only pass: a tensor the kernel cannot walk flat (a slice) is read through a dense copy.
    return OPS["multi_tensor_l2norm"]([t if t.is_contiguous() or is_dense(t) else t.contiguous() for t in tensors],
                                      per_tensor)


def _lr_for_kernel(lr: Scalar, device: torch.device):
    """(float lr, lr tensor or None): an lr tensor on the params' device is read there (no host
    read: a compiled step keeps one graph); a CPU lr tensor for CUDA params is a float."""
    if torch.is_tensor(lr) and (lr.device.type != "cpu" or device.type == "cpu"):
        return 0.0, lr.to(device=device, dtype=torch.float32).reshape(())
    return float(lr), None


def _step(op: str, reference_step, grads, params, buffers, steps, masters, lr, hyper, grad_scale, found_inf, fused,
          sr=None):
    """One optimizer step: ``torch.ops.mptrain.<op>_`` or ``reference_step``, both taking (grads, params,
    *buffers, steps, masters, lr, *hyper, grad_scale, found_inf); the op takes lr as (float, tensor).
    ``sr`` = (seed, tensor_offset): the stochastic-rounding op ``<op>_sr_`` (no masters; bf16 params)."""
    if not params:
        return
    device = params[0].device
    _check_found_inf(found_inf, device, op)
    gs = _device_scalar(grad_scale, device, "grad_scale", op)
    if masters is not None and len(masters) not in (0, len(params)):
        raise ValueError(f"{op}: {len(masters)} masters for {len(params)} params; pass one per param or none")
    if len(steps) != len(params):
        raise ValueError(f"{op}: {len(steps)} step counts for {len(params)} params")
    masters = list(masters or [])
    if sr is not None:
        _step_sr(op, reference_step, grads, params, buffers, steps, masters, lr, hyper, gs, found_inf, fused, sr)
        return
    if not _use_op(op, list(params) + list(grads), fused):
        reference_step(grads, params, *buffers, steps, masters, lr, *hyper, gs, found_inf)
    else:
        OPS[op + "_"](list(grads), list(params), *[list(b) for b in buffers], list(steps), masters,
                      *_lr_for_kernel(lr, device), *hyper, gs, found_inf)


def _step_sr(op, reference_step, grads, params, buffers, steps, masters, lr, hyper, gs, found_inf, fused, sr):
    seed, offset = int(sr[0]), int(sr[1])
    if masters:
        raise ValueError(f"{op}: stochastic rounding replaces the masters; pass none")
    bad = next((p.dtype for p in params if p.dtype != torch.bfloat16), None)
    if bad is not None:
        raise TypeError(f"{op}: stochastic rounding writes bfloat16 params, got {bad}; step other dtypes without sr")
    if not 0 <= offset <= 2 ** 32 - len(params):
        raise ValueError(f"{op}: sr tensor_offset={offset} must be >= 0 and keep every tensor id below 2^32")
    if not _use_op(op, list(params) + list(grads), fused):
        reference_step(grads, params, *buffers, steps, [], lr, *hyper, gs, found_inf, sr=(seed, offset))
    else:
        OPS[op + "_sr_"](list(grads), list(params), *[list(b) for b in buffers], list(steps),
                         *_lr_for_kernel(lr, params[0].device), *hyper, gs, found_inf, _int64(seed), offset)


def _int64(seed: int) -> int:
    """A 64-bit seed as the signed int64 the op schema carries (the kernels read the same 64 bits)."""
    seed &= 0xFFFFFFFFFFFFFFFF
    return seed - 2 ** 64 if seed >= 2 ** 63 else seed


_SR_DOC = """
    ``sr=(seed, tensor_offset)``: bf16 params without masters, fp32 state; the new weight is written with
    stochastic rounding from Philox keyed by (seed, step being taken), counter (tensor_offset + list index,
    element): :func:`stochastic_round` bit for bit (csrc/stochastic_round.cuh)."""


def multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, steps, masters=None, *, lr: Scalar, beta1: float,
                      beta2: float, eps: float, weight_decay: float, decoupled: bool, maximize: bool = False,
                      grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                      fused="auto", sr: Optional[tuple[int, int]] = None) -> None:
    """One Adam (``decoupled=False``) or AdamW step over lists of one dtype, in place. ``steps`` are
    float32 1-element counts (advanced here); ``masters`` (fp32, for fp16/bf16 params) carry the weights,
    the params get their rounded copy. Grads are divided by ``grad_scale``; a non-zero ``found_inf``
    leaves every tensor unchanged (the same holds for the SGD and LAMB steps)."""
    _step("multi_tensor_adam", reference.multi_tensor_adam, grads, params, (exp_avgs, exp_avg_sqs), steps, masters,
          lr, (beta1, beta2, eps, weight_decay, decoupled, maximize), grad_scale, found_inf, fused, sr)


def multi_tensor_sgd(grads, params, momentum_buffers, steps, masters=None, *, lr: Scalar, momentum: float,
                     dampening: float, weight_decay: float, nesterov: bool, maximize: bool = False,
                     grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                     fused="auto", sr: Optional[tuple[int, int]] = None) -> None:
    """One SGD step over lists of one dtype, in place (``momentum_buffers`` empty when
    momentum is 0). A step count of 0 marks new buffers: they start as the grad."""
    bufs = list(momentum_buffers) if momentum != 0 else []
    if params and momentum != 0 and len(bufs) != len(params):
        raise ValueError(f"multi_tensor_sgd: momentum={momentum} needs one buffer per param, got {len(bufs)}")
    _step("multi_tensor_sgd", reference.multi_tensor_sgd, grads, params, (bufs,), steps, masters, lr,
          (momentum, dampening, weight_decay, nesterov, maximize), grad_scale, found_inf, fused, sr)


def multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, steps, masters=None, *, lr: Scalar, beta1: float,
                      beta2: float, eps: float, weight_decay: float, bias_correction: bool = True,
                      maximize: bool = False, grad_scale: Optional[Scalar] = None,
                      found_inf: Optional[torch.Tensor] = None, fused="auto",
                      sr: Optional[tuple[int, int]] = None) -> None:
    """One LAMB step over lists of one dtype, in place (see csrc/multi_tensor_lamb.cu for the rule)."""
    _step("multi_tensor_lamb", reference.multi_tensor_lamb, grads, params, (exp_avgs, exp_avg_sqs), steps, masters,
          lr, (beta1, beta2, eps, weight_decay, bias_correction, maximize), grad_scale, found_inf, fused, sr)


for _fn in (multi_tensor_adam, multi_tensor_sgd, multi_tensor_lamb):
    _fn.__doc__ += _SR_DOC


def stochastic_round(x: torch.Tensor, seed: int, step: int, tensor: int = 0, *, fused="auto") -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 stochastically, as the bf16-sr optimizer steps round the new weight of
    tensor ``tensor`` at step ``step`` (unbiased; reproducible from ``(seed, step, tensor)``; inf and NaN kept).
    The result keeps ``x``'s dense layout."""
    if not _use_op("stochastic_round", x, fused):
        if not is_dense(x):
            x = x.contiguous()
        return reference.stochastic_round(x, seed, step, tensor)
    return OPS["stochastic_round"](x, _int64(seed), int(step), int(tensor))
