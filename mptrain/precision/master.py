"""``16-master`` and ``bf16-master``: half parameters, fp32 master weights in the optimizer step (apex's O2).

Norm layers keep fp32 weights; the masters start from the fp32 init.  mptrain's fused optimizers do the
whole step in one kernel (half grad + master in; master, moments and half param out; loss scale, clipping
and ``found_inf`` honoured on the device); any other optimizer gets its param groups swapped to fp32
masters, with grads copied up and params down by multi-tensor ops.  ``module.state_dict()`` reports
the masters' fp32 values and ``load_state_dict()`` writes fp32 values into the masters bitwise.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from mptrain import ops
from mptrain.compat import torch as compat
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision import grads as G
from mptrain.precision.fallback import half_params_fp32_norms
from mptrain.precision.fused_step import take_over_step
from mptrain.precision.plugin import MptrainPrecision, StepCheck, _unwrap_optimizer


class MasterPrecision(MptrainPrecision):
    """fp32 master weights for any optimizer; see the module docstring. Arguments as :class:`MptrainPrecision`."""

    MODES = {"16-master": torch.float16, "bf16-master": torch.bfloat16}
    SCALER_BY_DEFAULT = ("16-master",)
    has_master_weights = True
    RELEASES_CONSUMED_GRADS = True

    def __init__(self, precision: str = "bf16-master", **kwargs: Any):
        super().__init__(precision, **kwargs)
        self._fp32_init: dict[int, torch.Tensor] = {}  # id(half param) -> its fp32 value before the cast
        self._pairs: dict[int, tuple[list, list]] = {}  # optimizer id -> (half params, masters)
        self._master_of: dict[int, torch.Tensor] = {}  # id(half param) -> master (generic path)
        self._fused_of: dict[int, torch.optim.Optimizer] = {}  # id(half param) -> mptrain fused optimizer
        self._fused_norm: dict[int, torch.Tensor] = {}  # optimizer id -> norm of the unscaled grads
        self._fused_clip: dict[int, float] = {}  # optimizer id -> max_norm folded into grad_scale
        self._fused_unscaled: set[int] = set()  # optimizer ids whose half grads Fabric had unscaled
        self._converted: weakref.WeakSet = weakref.WeakSet()  # modules already converted

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_converted": None}  # a WeakSet does not pickle (ddp_spawn pickles the plugin)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._converted = weakref.WeakSet()

    def _convert(self, module: nn.Module) -> nn.Module:
        if module in self._converted:
            return module  # validate/test after fit set the module up again: hooks once
        self._converted.add(module)
        # The masters start from the full fp32 weights (apex O2 lost the init's low bits).
        self._hooks += half_params_fp32_norms(module, self.param_dtype,
                                              before_cast=lambda p: self._fp32_init.__setitem__(id(p), p.data))
        # torch tags hooks with attributes (a bound method takes none); partials also pickle with the module.
        cls = type(self)
        self._hooks.append(module.register_state_dict_post_hook(functools.partial(cls._state_dict_hook, self)))
        self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(cls._load_state_dict_hook, self)))
        return module

    def master_for(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 master of a half param (None if it has none)."""
        m = self._master_of.get(id(p))
        if m is not None:
            return m
        opt = self._fused_of.get(id(p))
        return opt.master_param(p) if opt is not None and opt.uses_master(p) else None

    def _state_dict_hook(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        if self.phase != "low":
            return
        for name, p in module.named_parameters():
            key = prefix + name
            if key in state and p.dtype in HALF_DTYPES:
                m = self.master_for(p)
                init = self._fp32_init.get(id(p))
                state[key] = m.detach() if m is not None else (init if init is not None else p.detach().float())
        for name, b in module.named_buffers():
            if prefix + name in state and b.dtype in HALF_DTYPES:
                state[prefix + name] = b.detach().float()

    def _load_state_dict_hook(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        """Loaded fp32 values go into the masters as they are (the half params get their cast)."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                v = state.get(prefix + name)
                if not isinstance(v, torch.Tensor) or not v.is_floating_point() or p.dtype not in HALF_DTYPES:
                    continue
                m = self.master_for(p)
                if m is not None:
                    m.copy_(v)
                else:
                    self._fp32_init[id(p)] = v.detach().to(p.device, torch.float32, copy=True)

    def _forget_optimizers(self) -> None:
        super()._forget_optimizers()
        self._pairs.clear()  # the masters themselves stay reachable through _master_of for the next setup

    def _release_fp32_init(self) -> None:
        self._fp32_init.clear()

    def _init_for(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value a new master starts from: the fp32 init or loaded weights, else a previous
        optimizer's master (a second ``fit``), else the half value itself."""
        init = self._fp32_init.pop(id(p), None)
        if init is None:
            init = self.master_for(p)
        return (init if init is not None else p).detach().to(p.device, torch.float32, copy=True)

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.fused is not False and not G.is_mptrain_fused(optimizer):
            take_over_step(optimizer, self.fused)  # torch's fused Adam/AdamW/SGD: our one-pass master step
        if G.is_mptrain_fused(optimizer):
            # The fused kernel keeps the fp32 master in its state and writes the half param back.
            optimizer.enable_master_weights()
            with torch.no_grad():
                for p in (p for g in optimizer.param_groups for p in g["params"]):
                    if optimizer.uses_master(p):
                        optimizer.master_param(p).copy_(self._init_for(p))
                        self._fused_of[id(p)] = optimizer
            return
        halfs = [p for g in optimizer.param_groups for p in g["params"] if p.dtype in HALF_DTYPES]
        masters = [nn.Parameter(self._init_for(p), requires_grad=p.requires_grad) for p in halfs]
        master_of = {id(p): m for p, m in zip(halfs, masters)}
        self._master_of.update(master_of)
        _swap_params(optimizer, master_of)
        self._pairs[id(optimizer)] = (halfs, masters)

    def main_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Generic path: half grads copied up into the masters' fp32 grads (one multi-tensor copy)."""
        pairs = list(zip(*self._pairs.get(id(optimizer), ((), ()))))  # (half param, master)
        for p, m in pairs:
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = torch.empty_like(m)
        with_grad = [(p, m) for p, m in pairs if p.grad is not None]
        if with_grad:
            ops.multi_tensor_copy_([m.grad for _, m in with_grad], [p.grad for p, _ in with_grad], fused=self.fused)
        return super().main_grads(optimizer)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self.phase != "low" or not G.is_mptrain_fused(optimizer):
            return super().unscale_and_check(optimizer)
        found = self._pending.get(id(optimizer))
        if found is not None:
            return found
        # Fused path: one read of the scaled half grads gives the inf check and the clipping norm;
        # they are never unscaled in place in half precision (small values would flush to zero).
        grads = super().main_grads(optimizer)
        dev = grads[0].device if grads else self._device()
        scale = self._scale(dev)
        norm = ops.multi_tensor_l2norm(grads, fused=self.fused).to(dev).float() / scale if grads else \
            torch.zeros((), device=dev)
        found = torch.maximum(self._found_inf(dev), (~torch.isfinite(norm)).float().reshape(1))
        G.all_reduce_max_(found)
        self._pending[id(optimizer)] = found
        self._fused_norm[id(optimizer)] = norm
        return found

    def step_check(self, optimizer: torch.optim.Optimizer) -> Optional[StepCheck]:
        check = super().step_check(optimizer)
        key = id(optimizer)
        return check._replace(grad_norm=self._fused_norm.get(key), max_norm=self._fused_clip.get(key)) if check \
            else None

    def set_step_check(self, optimizer: torch.optim.Optimizer, check: StepCheck) -> None:
        super().set_step_check(optimizer, check)
        if check.grad_norm is not None:
            self._fused_norm[id(optimizer)] = check.grad_norm

    def _unscaled_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        m = self._master_of.get(id(p))
        if m is not None:
            return m.grad if p.grad is not None else None
        opt = self._fused_of.get(id(p))
        if opt is None or p.grad is None or id(opt) in self._fused_unscaled:
            return p.grad
        return p.grad.float() / self._scale(p.grad.device)

    def _scale(self, device: torch.device, optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
        """The loss scale on ``device``; 1 without a scaler or once Fabric unscaled ``optimizer``'s half grads."""
        if self.loss_scaler is None or id(optimizer) in self._fused_unscaled:
            return torch.ones((), device=device)
        return self.loss_scaler.scale_tensor.to(device)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        optimizer = _unwrap_optimizer(optimizer)
        if self.phase != "low" or not G.is_mptrain_fused(optimizer) or not clip_val or clip_val <= 0:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        found = self.unscale_and_check(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            G.clip_scaled_by_value_(super().main_grads(optimizer), clip_val, self._scale(found.device, optimizer))
        else:
            self._fused_clip[id(optimizer)] = float(clip_val)  # folded into grad_scale at the step

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer = _unwrap_optimizer(optimizer)
        if self.phase == "low" and G.is_mptrain_fused(optimizer) and id(optimizer) not in self._fused_unscaled:
            # Fabric clips the params' grads itself: unscale them in place this once.
            found = self.unscale_and_check(optimizer)
            grads = super().main_grads(optimizer)
            if grads and self.loss_scaler is not None:
                G.unscale_and_check_(grads, self.loss_scaler.inv_scale().to(found.device),
                                     torch.zeros_like(found), self.fused)
            self._fused_unscaled.add(id(optimizer))
        super().unscale_gradients(optimizer)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, **kwargs: Any) -> None:
        if self.phase != "low" or not G.is_mptrain_fused(optimizer):
            return super()._optimizer_step(optimizer, found_inf, **kwargs)
        G.step_with_found_inf(optimizer, found_inf, grad_scale=self._fused_step_scale(optimizer, found_inf), **kwargs)

    def _step_scale(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Optional[torch.Tensor]:
        if self.phase != "low" or not G.is_mptrain_fused(optimizer):
            return super()._step_scale(optimizer, found_inf)
        return self._fused_step_scale(optimizer, found_inf)

    def _step_kwargs(self, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.phase == "low" and G.is_mptrain_fused(optimizer):
            # the engine never reads the grads after the step: no extra pass leaving them unscaled
            return {"unscale_grads": False, **kwargs}
        return super()._step_kwargs(optimizer, kwargs)

    def _fused_step_scale(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> torch.Tensor:
        """What the fused step divides the still-scaled half grads by: the loss scale and the clipping coefficient."""
        key = id(optimizer)
        scale = self._scale(found_inf.device, optimizer)
        max_norm = self._fused_clip.pop(key, None)
        if max_norm is not None:
            coef = torch.clamp(max_norm / (self._fused_norm[key] + 1e-6), max=1.0)
            scale = scale / torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        return scale

    def end_step(self, optimizer: torch.optim.Optimizer) -> None:
        pair = self._pairs.get(id(optimizer))
        if pair is not None and pair[0]:
            with torch.no_grad():
                compat.foreach_copy_(pair[0], pair[1])  # masters down into the half params
            # The window's grads are consumed: the half ones and the masters' fp32 copies go now, not at the
            # next zero_grad, which Lightning calls after the next forward (the fp32 set would sit through it).
            for p, m in zip(*pair):
                p.grad = m.grad = None
        self._fused_norm.pop(id(optimizer), None)
        self._fused_clip.pop(id(optimizer), None)  # a step that ended without stepping leaves none behind
        self._fused_unscaled.discard(id(optimizer))
        super().end_step(optimizer)

    def _to_fp32(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if G.is_mptrain_fused(optimizer):
            optimizer.disable_master_weights()  # masters become the params, fp32 moments stay
        elif id(optimizer) in self._pairs:
            halfs, masters = self._pairs.pop(id(optimizer))
            for p, m in zip(halfs, masters):
                p.data, p.grad = m.data, None
            _swap_params(optimizer, {id(m): p for p, m in zip(halfs, masters)})
        super()._to_fp32(model, optimizer)
        self._master_of.clear()
        self._fused_of.clear()

    def promote_module(self, module: nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters():
                m = self.master_for(p)
                p.data = m.detach().clone() if m is not None else p.data.float()
        super().promote_module(module)


def _swap_params(optimizer: torch.optim.Optimizer, replace: dict[int, torch.Tensor]) -> None:
    """Params whose id is in ``replace`` give way to their replacement in the groups; their state moves along."""
    for group in optimizer.param_groups:
        for q in group["params"]:
            if id(q) in replace and q in optimizer.state:  # an optimizer that already holds state
                optimizer.state[replace[id(q)]] = optimizer.state.pop(q)
        group["params"] = [replace.get(id(q), q) for q in group["params"]]
