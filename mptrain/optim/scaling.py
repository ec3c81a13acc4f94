"""Loss scaling inside the fused step (the protocol is in :mod:`mptrain.optim`): where ``grad_scale``
/ ``found_inf`` come from (step arguments, then checked here; or GradScaler's attributes, trusted),
the inf check, and leaving taken steps' grads divided by ``grad_scale`` as torch's fused optimizers do.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Union

import torch

from mptrain.ops.multi_tensor import multi_tensor_check_finite_, multi_tensor_scale_

from .layout import is_dense

Scale = Optional[Union[torch.Tensor, float]]


def scaling_inputs(optimizer, grad_scale: Scale, found_inf: Optional[torch.Tensor]) -> tuple[Scale, object, bool]:
    """(grad_scale, found_inf, check): the explicit arguments (then the step runs its
    own inf check) or else the attributes of the GradScaler protocol (trusted)."""
    name = type(optimizer).__name__
    check = grad_scale is not None or found_inf is not None
    if not check:
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and (not torch.is_tensor(found_inf) or found_inf.dtype != torch.float32
                                  or found_inf.numel() != 1):
        raise TypeError(f"{name}.step: found_inf must be a float32 tensor with one element, got "
                        f"{found_inf!r:.80}; create it with torch.zeros(1, device=...)")
    if torch.is_tensor(grad_scale) and grad_scale.numel() != 1:
        raise TypeError(f"{name}.step: grad_scale must hold one value, got shape {tuple(grad_scale.shape)}")
    return grad_scale, found_inf, check


def found_inf_per_device(buckets: dict, found_inf: Optional[torch.Tensor], check: bool, fused) -> dict:
    """found_inf for every device of ``buckets`` (keys ``(group index, device, dtype, master)``), all agreeing; when
    ``check`` the grads are checked here and the result is written into the caller's ``found_inf`` in place."""
    devices = list(dict.fromkeys(key[1] for key in buckets))
    if not check:
        if found_inf is None:
            return {}
        return {d: found_inf if found_inf.device == d else found_inf.to(d, non_blocking=True) for d in devices}
    home = found_inf if found_inf is not None else torch.zeros((), dtype=torch.float32, device=devices[0])
    local = {d: home if home.device == d else torch.zeros((), dtype=torch.float32, device=d) for d in devices}
    grads = defaultdict(list)
    for key, params in buckets.items():
        # The check walks each grad flat: a non-dense one (an expanded grad) is read through a copy.
        grads[key[1]].extend(p.grad if is_dense(p.grad) else p.grad.contiguous() for p in params)
    for d in devices:
        multi_tensor_check_finite_(grads[d], local[d], fused=fused)
    if any(local[d] is not home for d in devices):  # params on several devices, or found_inf elsewhere
        for d in devices:
            if local[d] is not home:
                home.copy_(torch.maximum(home, local[d].to(home.device).reshape(home.shape)))
        local = {d: home if home.device == d else home.to(d) for d in devices}
    return local


def unscale_grads_(buckets: dict, grad_scale: Scale, per_device_inf: dict, fused) -> None:
    """``grad *= 1 / grad_scale`` for every stepped grad, on the device (no host sync), in one multi-tensor launch per
    dtype (torch's ``_foreach_div_`` by a tensor falls back to one launch per grad for half grads); by 1 where the step
    was skipped, so skipped grads keep their values. Products are exact for power-of-two scales (GradScaler's)."""
    by_device = defaultdict(list)
    for key, params in buckets.items():
        by_device[key[1]].extend(params)
    for device, params in by_device.items():
        if torch.is_tensor(grad_scale):
            inv = torch.reciprocal(grad_scale.to(device=device, dtype=torch.float32, non_blocking=True).reshape(()))
        else:
            inv = torch.full((), 1.0 / float(grad_scale), dtype=torch.float32, device=device)
        inf = per_device_inf.get(device)
        if inf is not None:
            inv = torch.where(inf.reshape(()) != 0, torch.ones_like(inv), inv)
        dense, awkward = [], []
        for p in params:
            (dense if is_dense(p.grad) else awkward).append(p)
        grads = [p.grad for p in dense]
        multi_tensor_scale_(grads, grads, inv, fused=fused)
        for p in awkward:  # e.g. an expanded grad, which cannot be written in place
            p.grad = (p.grad.float() * inv).to(p.grad.dtype)
