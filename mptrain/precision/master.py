"""``16-master`` and ``bf16-master``: half parameters, fp32 master weights in the optimizer step.

apex's O2 done right.  The module holds fp16/bf16 weights (half the memory and
bandwidth of fp32), normalization layers keep fp32 weights and compute in fp32,
and the optimizer updates fp32 masters:

* with one of mptrain's fused optimizers the whole step is one kernel: it reads the
  half grad and the master, writes master, moments and the half param, honouring the
  loss scale and ``found_inf`` on the device;
* with any other ``torch.optim.Optimizer`` the param groups are swapped to fp32
  masters; grads are copied up and params down with multi-tensor (``_foreach``) ops.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from mptrain.precision._cast import cast_floating
from mptrain.precision.base import Precision, is_mptrain_fused
from mptrain.precision.fallback import is_norm_module, run_module_in_fp32

_DTYPES = {"16-master": torch.float16, "bf16-master": torch.bfloat16}
_HALF = (torch.float16, torch.bfloat16)


class MasterPrecision(Precision):
    has_master_weights = True

    def __init__(self, name: str = "bf16-master", device="cpu", fp32_fallback: Any = "default"):
        if name not in _DTYPES:
            raise ValueError(f"MasterPrecision: precision={name!r} is not a master mode; valid: {sorted(_DTYPES)}")
        self.name = name
        self.param_dtype = self.compute_dtype = _DTYPES[name]
        self.default_scaler = name == "16-master"
        super().__init__(device, fp32_fallback)
        self.halfs: list[torch.Tensor] = []  # module params held in half
        self.masters: list[torch.Tensor] = []  # their fp32 masters (generic path)
        self.master_of: dict[int, torch.Tensor] = {}
        self.fused = False
        self._names: dict[int, str] = {}
        self._fp32_init: dict[int, torch.Tensor] = {}

    # -- module ----------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        for m in module.modules():
            if is_norm_module(m):
                m.float()
                self._hooks += run_module_in_fp32(m)
                continue
            for name, p in m.named_parameters(recurse=False):
                if p.is_floating_point():
                    if p.dtype == torch.float32:
                        # The masters start from the full fp32 weights, not from their half copy
                        # (apex O2 builds them from the halved model and loses the init's low bits).
                        self._fp32_init[id(p)] = p.data
                    p.data = p.data.to(self.param_dtype)
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.to(self.param_dtype))
        self._names = {id(p): n for n, p in module.named_parameters()}
        return module

    def convert_input(self, data: Any) -> Any:
        return cast_floating(data, self.param_dtype)

    # -- optimizer -------------------------------------------------------
    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        self._names = {id(p): n for n, p in module.named_parameters()}
        if is_mptrain_fused(optimizer):
            # The fused kernel keeps the fp32 master in its own state and writes the half param back.
            if hasattr(optimizer, "enable_master_weights"):
                optimizer.enable_master_weights()
            else:
                optimizer.master_weights = True
            self.fused = True
            with torch.no_grad():
                for g in optimizer.param_groups:
                    for p in g["params"]:
                        init = self._fp32_init.pop(id(p), None)
                        if init is not None and optimizer.uses_master(p):
                            optimizer.master_param(p).copy_(init)
            self._fp32_init.clear()
            return optimizer
        self.halfs, self.masters, self.master_of = [], [], {}
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                if p.dtype in _HALF:
                    init = self._fp32_init.pop(id(p), None)
                    master = nn.Parameter(init if init is not None else p.detach().float(), requires_grad=p.requires_grad)
                    if p in optimizer.state:  # an optimizer that already holds state (rare)
                        optimizer.state[master] = optimizer.state.pop(p)
                    self.halfs.append(p)
                    self.masters.append(master)
                    self.master_of[id(p)] = master
                    swapped.append(master)
                else:
                    swapped.append(p)
            group["params"] = swapped
        self._fp32_init.clear()
        return optimizer

    def discard_fp32_init(self) -> None:
        self._fp32_init.clear()

    def step_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if self.fused:
            return super().step_grads(optimizer)
        src, dst = [], []
        for p, m in zip(self.halfs, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None or m.grad.shape != m.shape:
                m.grad = torch.empty_like(m)
            src.append(p.grad)
            dst.append(m.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def optimizer_step(self, optimizer, scaler, gradient_clip_val, before_step=None, sync_found_inf=None):
        if not self.fused:
            return super().optimizer_step(optimizer, scaler, gradient_clip_val, before_step, sync_found_inf)
        return self._fused_step(optimizer, scaler, gradient_clip_val, before_step, sync_found_inf)

    def _fused_step(self, optimizer, scaler, gradient_clip_val, before_step, sync_found_inf):
        """One pass to get the norm of the scaled half grads, then one fused step kernel.

        The norm is the inf check (a non-finite grad makes it non-finite) and the
        clipping coefficient; both fold into ``grad_scale`` so the grads are never
        unscaled in place in half precision (where small values would flush to zero).
        """
        from mptrain import ops

        grads = super().step_grads(optimizer)
        dev = grads[0].device if grads else self.device
        scale = scaler.scale_tensor.to(dev) if scaler is not None else torch.ones((), device=dev)
        norm = ops.multi_tensor_l2norm(grads).to(dev).float() / scale if grads else torch.zeros((), device=dev)
        found_inf = (~torch.isfinite(norm)).float().reshape(1)
        if sync_found_inf is not None:
            sync_found_inf(found_inf)
        grad_scale = scale
        if gradient_clip_val is not None:
            coef = torch.clamp(gradient_clip_val / (norm + 1e-6), max=1.0)
            grad_scale = scale / torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        self._fused_found_inf = found_inf
        self._fused_scale = scale
        if before_step is not None:
            before_step(found_inf)
        # As attributes (torch's GradScaler protocol): found_inf is trusted as computed by the
        # norm above, so the optimizer runs no second read-only inf check over the grads.
        optimizer.grad_scale = grad_scale.reshape(1).float()
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        if scaler is not None:
            scaler.update(found_inf)
        return norm, found_inf

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.fused or not self.halfs:
            return
        with torch.no_grad():
            torch._foreach_copy_(self.halfs, self.masters)

    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        # Master grads are persistent buffers, overwritten by the copy-up each step.
        module.zero_grad(set_to_none=True)
        if self.fused:
            optimizer.zero_grad(set_to_none=True)

    def unscaled_grads(self, module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in module.named_parameters():
            if self.fused:
                if p.grad is not None:
                    out[n] = p.grad.float() / self._fused_scale
            else:
                m = self.master_of.get(id(p))
                g = m.grad if m is not None else p.grad
                if g is not None and (m is None or p.grad is not None):
                    out[n] = g
        return out

    # -- weights for checkpoints -----------------------------------------
    def master_for(self, p: torch.Tensor, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[torch.Tensor]:
        if self.fused and optimizer is not None:
            st = optimizer.state.get(p, {})
            return st.get("master_param")
        return self.master_of.get(id(p))

    def fp32_state_dict(self, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
        state = super().fp32_state_dict(module)
        for n, p in module.named_parameters():
            m = self.master_for(p, optimizer)
            if m is not None and n in state:
                state[n] = m.detach().clone()
        return state

    def load_fp32_state_dict(self, module: nn.Module, state: dict, optimizer=None) -> None:
        super().load_fp32_state_dict(module, state)
        with torch.no_grad():
            for n, p in module.named_parameters():
                m = self.master_of.get(id(p))
                if m is not None and n in state:
                    m.copy_(state[n])

    def to_fp32(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Late-epoch switch: params become the fp32 masters, the optimizer state carries over."""
        if self.fused:
            if hasattr(optimizer, "disable_master_weights"):
                optimizer.disable_master_weights()  # copies masters into the params, drops them from state
            else:
                for g in optimizer.param_groups:
                    for p in g["params"]:
                        m = optimizer.state.get(p, {}).pop("master_param", None)
                        p.data = m if m is not None else p.data.float()
                optimizer.master_weights = False
        else:
            back = {id(m): p for p, m in zip(self.halfs, self.masters)}
            for group in optimizer.param_groups:
                new = []
                for q in group["params"]:
                    p = back.get(id(q))
                    if p is None:
                        new.append(q)
                        continue
                    p.data = q.data
                    p.grad = None
                    if q in optimizer.state:
                        optimizer.state[p] = optimizer.state.pop(q)
                    new.append(p)
                group["params"] = new
        module.float()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.halfs, self.masters, self.master_of = [], [], {}

    def promote_module(self, module: nn.Module, optimizer) -> None:
        with torch.no_grad():
            for p in module.parameters():
                m = self.master_for(p, optimizer)
                p.data = m.detach().clone() if m is not None else p.data.float()
        super().promote_module(module, optimizer)

