"""What every fused optimizer shares: bucketing by device/dtype, fp32 master weights,
the grad_scale / found_inf protocol, and a state_dict that keeps fp32 state fp32.

Subclasses say which per-parameter buffers they keep (``_buffers``) and how one
bucket of same-dtype tensors is updated (``_update``); the kernels live in
:mod:`mptrain.ops.multi_tensor`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Union

import torch

from mptrain.ops.multi_tensor import FUSED_CHOICES, multi_tensor_check_finite_

HALF_DTYPES = (torch.float16, torch.bfloat16)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class; see :mod:`mptrain.optim` for the step() protocol."""

    # torch.amp.GradScaler hands such optimizers `grad_scale` / `found_inf` as
    # attributes instead of unscaling the grads itself.
    _step_supports_amp_scaling = True
    # mptrain.precision hands its whole master-weight step to these (precision/base.py).
    _mptrain_fused = True

    def __init__(self, params, defaults: dict, *, master_weights: bool, capturable: bool, fused):
        if fused is None:
            fused = "auto"
        if fused not in FUSED_CHOICES:
            raise ValueError(f"{type(self).__name__}: fused={fused!r}; expected one of {FUSED_CHOICES}")
        defaults = dict(defaults, capturable=capturable)
        super().__init__(params, defaults)
        self.master_weights = bool(master_weights)
        self.fused = fused
        if capturable:
            for group in self.param_groups:
                for p in group["params"]:
                    if not p.is_cuda:
                        raise ValueError(f"{type(self).__name__}: capturable=True needs CUDA params, got one on "
                                         f"{p.device}")

    # ------------------------------------------------------------ per-subclass

    def _buffers(self, group: dict) -> tuple[str, ...]:
        """Names of the per-parameter state tensors shaped like the param."""
        raise NotImplementedError

    def _update(self, group: dict, params: list, grads: list, state: dict, masters: list,
                grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
        """Update one bucket (one device, one param dtype); ``state[name]`` are lists."""
        raise NotImplementedError

    # ------------------------------------------------------------ master weights

    def uses_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated through an fp32 master copy kept in the state."""
        return self.master_weights and p.dtype in HALF_DTYPES

    def master_param(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 weights that ``p`` is updated from: the master (state['master_param'],
        created from ``p`` if missing) when ``p`` is half and master_weights=True, else
        ``p`` itself. The precision engine copies exact fp32 weights into it after
        halving a model, and reads it for fp32 checkpoints."""
        if not self.uses_master(p):
            return p
        st = self.state[p]
        if "master_param" not in st:
            st["master_param"] = p.detach().to(torch.float32, copy=True)
        return st["master_param"]

    @torch.no_grad()
    def enable_master_weights(self) -> None:
        """Switch to fp32 master weights (the ``*-master`` precisions call this): every
        fp16/bf16 param gets its master now, from its current value, and existing moments
        become fp32."""
        self.master_weights = True
        for group in self.param_groups:
            for p in group["params"]:
                if self.uses_master(p):
                    self.master_param(p)
                    st = self.state[p]
                    for name in self._buffers(group):
                        if name in st:
                            st[name] = st[name].float()

    @torch.no_grad()
    def disable_master_weights(self) -> None:
        """Leave master weights (the late-epoch switch to fp32): each param with a master
        becomes that fp32 tensor, the master leaves the state, the fp32 moments stay."""
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).pop("master_param", None)
                if master is not None:
                    p.data = master
                    p.grad = None
        self.master_weights = False

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        master = self.uses_master(p)
        if master:
            self.master_param(p)
        dtype = torch.float32 if master else p.dtype
        for name in self._buffers(group):
            if name not in st:
                st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return st

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *,
             grad_scale: Optional[Union[torch.Tensor, float]] = None, found_inf: Optional[torch.Tensor] = None):
        """One optimizer step; see :mod:`mptrain.optim` for ``grad_scale`` / ``found_inf``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check = grad_scale is not None or found_inf is not None
        if not check:  # torch.amp.GradScaler's protocol: it already computed found_inf
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
        buckets = self._buckets()
        if not buckets:
            return loss
        per_device_inf = self._found_inf_per_device(buckets, found_inf, check)
        for (group_key, device, _dtype, _master), params in buckets.items():
            group = group_key.group
            grads = [self._grad_of(p) for p in params]
            states = [self._init_state(p, group) for p in params]
            state = {name: [st[name] for st in states] for name in ("step",) + self._buffers(group)}
            masters = [st["master_param"] for st in states] if self.uses_master(params[0]) else []
            gs = grad_scale.to(device, non_blocking=True) if torch.is_tensor(grad_scale) else grad_scale
            self._update(group, params, grads, state, masters, gs, per_device_inf.get(device))
        return loss

    def _buckets(self) -> dict:
        """(group key, device, dtype, master) -> params with a grad, in parameter order."""
        out: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                key = (_GroupKey(group), p.device, p.dtype, self.uses_master(p))
                out.setdefault(key, []).append(p)
        return out

    @staticmethod
    def _grad_of(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g.stride() == p.stride() or p.numel() <= 1:
            return g
        # The kernels walk param, grad and state as one flat array: give the grad the
        # param's layout (rare: e.g. a grad produced by an expand).
        return torch.empty_like(p).copy_(g)

    def _found_inf_per_device(self, buckets: dict, found_inf, check: bool) -> dict:
        """found_inf for every device (checked here when ``check``), all agreeing."""
        devices = list(dict.fromkeys(key[1] for key in buckets))
        if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
            raise TypeError(f"{type(self).__name__}.step: found_inf must be a float32 tensor with one element, got "
                            f"{found_inf.dtype} with {found_inf.numel()} elements")
        if not check:
            if found_inf is None:
                return {}
            return {d: found_inf.to(d, non_blocking=True).reshape(()) for d in devices}
        home = found_inf if found_inf is not None else torch.zeros((), dtype=torch.float32, device=devices[0])
        local = {d: home if home.device == d else torch.zeros((), dtype=torch.float32, device=d) for d in devices}
        grads = defaultdict(list)
        for key, params in buckets.items():
            grads[key[1]].extend(self._grad_of(p) for p in params)
        for d in devices:
            multi_tensor_check_finite_(grads[d], local[d], fused=self.fused)
        if any(local[d] is not home for d in devices):  # params on several devices, or found_inf elsewhere
            for d in devices:
                if local[d] is not home:
                    home.copy_(torch.maximum(home, local[d].to(home.device).reshape(home.shape)))
            local = {d: home if home.device == d else home.to(d) for d in devices}
        return local

    # ------------------------------------------------------------ state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader would cast every state tensor to the param's dtype, turning the
        fp32 master and moments of half params into half: restore them in fp32."""
        saved = {pid: dict(st) for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if pid not in saved:
                continue
            st = self.state[p]
            for name, value in saved[pid].items():
                if not torch.is_tensor(value):
                    continue
                if name == "step":
                    st[name] = value.detach().to(device=p.device, dtype=torch.float32).reshape(()).clone()
                elif name == "master_param" and not self.uses_master(p):
                    st.pop(name, None)
                else:
                    dtype = torch.float32 if self.uses_master(p) else p.dtype
                    st[name] = value.detach().to(device=p.device, dtype=dtype).clone()
            if "step" not in st and st:
                # A state written by torch.optim.SGD (no step count): the buffers exist, so not a first step.
                st["step"] = torch.ones((), dtype=torch.float32, device=p.device)


class _GroupKey:
    """Param groups are dicts (unhashable); bucket them by identity."""

    __slots__ = ("group",)

    def __init__(self, group: dict):
        self.group = group

    def __hash__(self) -> int:
        return id(self.group)

    def __eq__(self, other) -> bool:
        return isinstance(other, _GroupKey) and other.group is self.group
