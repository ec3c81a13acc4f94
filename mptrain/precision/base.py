"""The Precision protocol: what the Trainer asks of a precision mode.

One mode per file behind these hooks (as Lightning Fabric's precision plugins); the
Trainer never branches on the precision string.  The optimizer step lives here
because it is where precision matters most: grads are copied up (``*-master``),
unscaled and checked for inf/NaN, clipped, and the step is skipped on the device.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from mptrain.precision.fallback import AutoFallback, Fp32Fallback, run_module_in_fp32

_HALF = (torch.float16, torch.bfloat16)


def is_mptrain_fused(optimizer: torch.optim.Optimizer) -> bool:
    """mptrain's own fused optimizers take grad_scale/found_inf and master weights in one kernel."""
    return bool(getattr(optimizer, "_mptrain_fused", False))


def accepts_device_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused optimizers read ``grad_scale``/``found_inf`` attributes and skip on the device."""
    if is_mptrain_fused(optimizer):
        return True
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return all(g.get("fused", False) for g in optimizer.param_groups)


def unscale_and_check_(
    grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor, use_ops: bool = True
) -> None:
    """grads *= inv_scale in place; found_inf becomes 1 if any grad is inf/NaN. No host sync.

    ``use_ops``: mptrain's multi-tensor kernel (any dtype, one launch per list); otherwise
    torch's ``_amp_foreach_non_finite_check_and_unscale_``.
    """
    if not grads:
        return
    if use_ops:
        from mptrain import ops

        ops.multi_tensor_unscale_(grads, inv_scale, found_inf)
        return
    by_dev: dict = {}
    for g in grads:
        by_dev.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), gs in by_dev.items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, local, inv_scale.to(dev))
        found_inf.add_(local.to(found_inf.device).reshape(found_inf.shape))


def grad_norm_(grads: list[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
    """Global L2 norm of ``grads`` (a device tensor); clip them to ``max_norm`` if given."""
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


class Precision:
    """Base class of every precision mode.

    Attributes:
        name: the public precision string (one of ``mptrain.PRECISIONS``).
        param_dtype: dtype of the module's parameters after ``convert_module``
            (normalization layers keep fp32 in ``*-master``).
        compute_dtype: dtype most of the arithmetic runs in.
        autocast_dtype: dtype of ``torch.autocast`` in ``forward_context``, or None.
        has_master_weights: the optimizer steps fp32 copies of half parameters.
        default_scaler: whether a DynamicLossScaler is on unless the user says otherwise.
    """

    name: str = "32-true"
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    autocast_dtype: Optional[torch.dtype] = None
    has_master_weights: bool = False
    default_scaler: bool = False
    use_fused_ops: bool = True  # Trainer(fused=False) turns mptrain's kernels off

    def __init__(self, device: torch.device | str = "cpu", fp32_fallback: Any = "default"):
        self.device = torch.device(device)
        low = self.compute_dtype in _HALF
        self.fallback: Optional[Fp32Fallback] = Fp32Fallback(fp32_fallback) if low else None
        if self.fallback is not None and not self.fallback.ops:
            self.fallback = None
        self.auto: Optional[AutoFallback] = None
        self._hooks: list = []

    # -- module and data -------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module's parameters and buffers as the mode requires (in place)."""
        return module

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point tensors of a batch to what the module expects."""
        return data

    def forward_context(self) -> ContextManager:
        """Context for forward passes: autocast and the fp32 fallback of listed ops."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        if self.fallback is not None:
            stack.enter_context(self.fallback.context())
        return stack

    def enable_auto_fallback(self, module: nn.Module) -> None:
        """Watch leaf modules' outputs for inf/NaN (``auto_fp32_fallback=True``)."""
        if self.compute_dtype in _HALF:
            self.auto = AutoFallback(module)

    def promote_module(self, module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Run ``module`` in fp32 for the rest of the run (params, compute; output keeps its dtype)."""
        module._mpt_promoted = True
        if self.autocast_dtype is not None:
            orig = module.forward
            dev = self.device.type

            def forward(*args, **kwargs):
                with torch.autocast(dev, enabled=False):
                    return orig(*args, **kwargs)

            module.forward = forward
        self._hooks += run_module_in_fp32(module)

    # -- backward and optimizer -----------------------------------------
    def backward(self, loss: torch.Tensor, scaler) -> None:
        (scaler.scale_loss(loss) if scaler is not None else loss).backward()

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        """Prepare the optimizer (``*-master`` swaps its param groups to fp32 masters)."""
        return optimizer

    def discard_fp32_init(self) -> None:
        """Drop any fp32 copies kept for building masters (validate-only runs never build them)."""

    def step_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The grads the optimizer will read (``*-master`` copies them up first)."""
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def unscaled_grads(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Unscaled grads by the module's parameter names (valid after ``unscale``)."""
        return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        scaler,
        gradient_clip_val: Optional[float],
        before_step=None,
        sync_found_inf=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, check, clip and step; returns (grad_norm, found_inf) as device tensors.

        ``before_step(found_inf)`` runs after unscaling (callbacks); ``sync_found_inf``
        all-reduces found_inf across ranks when grads are sharded.
        """
        grads = self.step_grads(optimizer)
        dev = grads[0].device if grads else self.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
        if scaler is not None:
            unscale_and_check_(grads, scaler.inv_scale().to(dev), found_inf, self.use_fused_ops)
        if sync_found_inf is not None:
            sync_found_inf(found_inf)
        grad_norm = grad_norm_(grads, gradient_clip_val)
        if before_step is not None:
            before_step(found_inf)
        self._step(optimizer, found_inf if scaler is not None else None)
        if scaler is not None:
            scaler.update(found_inf)
        self.after_step(optimizer)
        return grad_norm, found_inf

    def _step(self, optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor]) -> None:
        if found_inf is None:
            optimizer.step()
        elif accepts_device_found_inf(optimizer):
            # Grads are already unscaled: grad_scale=None, the kernel only honours found_inf.
            optimizer.grad_scale = None
            # torch's fused Adam subtracts found_inf from its 0-dim step counts in place: 0-dim here.
            optimizer.found_inf = found_inf if is_mptrain_fused(optimizer) else found_inf.reshape(())
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
        elif not bool(found_inf.item()):  # one host sync per step, as torch's GradScaler does
            optimizer.step()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After a (possibly skipped) optimizer step: ``*-master`` copies params down."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        optimizer.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)

    # -- weights for checkpoints -----------------------------------------
    def fp32_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state dict with every floating tensor in fp32 (masters where they exist)."""
        return {k: (v.float() if v.is_floating_point() else v) for k, v in module.state_dict().items()}

    def load_fp32_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor], optimizer=None) -> None:
        """Load fp32 weights into the (converted) module, keeping each tensor's current dtype."""
        own = module.state_dict()
        cast = {k: (v.to(own[k].dtype) if k in own and v.is_floating_point() else v) for k, v in state.items()}
        module.load_state_dict(cast)

    def state_dict(self) -> dict:
        return {"name": self.name, "promoted": sorted(self.auto.promoted) if self.auto else []}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def require_fused_ops() -> None:
    """``fused=True`` on CUDA: the extension must build and load, or fail now with its reason."""
    from mptrain import ops

    ops.get_extension(required=True)  # raises with the failing file, the log and the fix
