"""Gradient passes of the optimizer step, all on the device: ``found_inf`` is a 1-element float32 tensor
(nonzero = skip this step) that the optimizer honours without a host sync when it can."""
from __future__ import annotations

from typing import Optional

import torch

from mptrain import ops
from mptrain.compat import torch as compat


def is_mptrain_fused(optimizer: torch.optim.Optimizer) -> bool:
    """mptrain's fused optimizers take grad_scale/found_inf and master weights in one kernel."""
    return bool(getattr(optimizer, "_mptrain_fused", False))


def accepts_device_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` on the device: mptrain's fused optimizers and torch's
    ``fused=True`` ones (the ``grad_scale`` / ``found_inf`` attributes of torch.amp.GradScaler's protocol)."""
    return is_mptrain_fused(optimizer) or (compat.supports_amp_scaling(optimizer)
                                           and all(g.get("fused", False) for g in optimizer.param_groups))


def unscale_and_check_(grads: list[torch.Tensor], inv_scale: Optional[torch.Tensor], found_inf: torch.Tensor,
                       fused="auto") -> None:
    """``grads *= inv_scale`` in place (``None``: only check); ``found_inf`` becomes 1 on any inf/NaN."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        local = found_inf if found_inf.device == device else torch.zeros(1, dtype=torch.float32, device=device)
        if inv_scale is None:
            ops.multi_tensor_scale_(gs, [], None, local, fused=fused)  # empty destination: check only
        else:
            ops.multi_tensor_unscale_(gs, inv_scale.to(device), local, fused=fused)
        if local is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, local.to(found_inf.device)))


def clip_scaled_by_value_(grads: list[torch.Tensor], clip_val: float, scale: torch.Tensor) -> None:
    """Value clipping of still-scaled half grads: the bound ``clip_val * scale`` is applied in fp32."""
    for g in grads:
        bound = (scale * clip_val).to(g.device)
        g.copy_(torch.clamp(g.float(), min=-bound, max=bound))


def all_reduce_max_(found_inf: torch.Tensor) -> None:
    """Every rank takes the same skip decision: found_inf = max over ranks (on the device)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


def step_with_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                        grad_scale: Optional[torch.Tensor] = None, **kwargs) -> None:
    """Step, or skip when ``found_inf`` is set: on the device where the optimizer can, else after one host read
    (as GradScaler does)."""
    if not accepts_device_found_inf(optimizer):
        if not bool(found_inf.item()):
            optimizer.step(**kwargs)
        return
    optimizer.grad_scale = grad_scale.reshape(1).float() if grad_scale is not None else None
    # torch's fused Adam subtracts found_inf from its 0-dim step counts in place: 0-dim there.
    optimizer.found_inf = found_inf if is_mptrain_fused(optimizer) else found_inf.reshape(())
    if is_mptrain_fused(optimizer) and grad_scale is not None:
        # The engine never reads the grads after the step: skip the optimizer's extra pass that
        # leaves them unscaled (done for GradScaler parity, which torch's fused optimizers keep).
        kwargs.setdefault("unscale_grads", False)
    try:
        optimizer.step(**kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


def arm_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
             grad_scale: Optional[torch.Tensor] = None) -> None:
    """Make the running ``optimizer.step(closure)`` honour ``found_inf`` once its closure returned: on the device
    where the optimizer reads ``grad_scale`` / ``found_inf`` after its closure (GradScaler's protocol), else after
    one host read, a step to skip finds no gradient (torch's optimizers leave such parameters and their state as
    they are).  :func:`disarm_step` undoes it."""
    if accepts_device_found_inf(optimizer):
        optimizer.grad_scale = grad_scale.reshape(1).float() if grad_scale is not None else None
        optimizer.found_inf = found_inf if is_mptrain_fused(optimizer) else found_inf.reshape(())
    elif bool(found_inf.item()):
        hide_grads(optimizer)


def hide_grads(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's grads set aside (``None``) until :func:`disarm_step`: its step updates nothing."""
    hidden = vars(optimizer).setdefault("_mptrain_hidden_grads", [])
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                hidden.append((p, p.grad))
                p.grad = None


def disarm_step(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`arm_step`: attributes removed, hidden grads back in place."""
    state = vars(optimizer)
    state.pop("grad_scale", None)
    state.pop("found_inf", None)
    for p, grad in state.pop("_mptrain_hidden_grads", ()):
        p.grad = grad
