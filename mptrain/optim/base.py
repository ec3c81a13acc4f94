"""What every fused optimizer shares: bucketing by device/dtype, fp32 master weights, loss scaling
(:mod:`.scaling`), layouts (:mod:`.layout`), torch.optim's state formats (:mod:`.torch_format`), pickling.
Subclasses define ``_buffers``, ``_check_group``, ``_format_defaults`` and ``_update``.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from mptrain.ops.dispatch import check_fused
from mptrain.ops.dtypes import HALF_DTYPES

from .layout import dense_work_lists
from .scaling import found_inf_per_device, scaling_inputs, unscale_grads_
from .torch_format import normalize_steps, restore_state_tensors


class FusedOptimizer(torch.optim.Optimizer):
    """Base class; see :mod:`mptrain.optim` for the step() protocol."""

    # torch.amp.GradScaler hands such optimizers `grad_scale` / `found_inf` instead of unscaling the grads.
    _step_supports_amp_scaling = True
    # mptrain.precision hands its whole master-weight step to these (precision/master.py).
    _mptrain_fused = True
    # The seed while bf16 params round stochastically (enable_stochastic_rounding), else None; also the value of an
    # instance made without __init__ (an optimizer whose class became this one in place).
    stochastic_rounding: Optional[int] = None
    # Instance attributes torch's __getstate__ leaves out (deepcopy and pickle need them), with the value
    # an object pickled without them gets.
    _instance_attrs = {"master_weights": False, "fused": "auto", "stochastic_rounding": None}
    # Group keys that older torch formats lack, with the value torch fills in.
    _format_defaults: dict = {"capturable": False}

    def __init__(self, params, defaults: dict, *, master_weights: bool, capturable: bool, fused):
        self.master_weights = bool(master_weights)
        self.stochastic_rounding: Optional[int] = None  # the seed, while bf16 params round stochastically
        self.fused = check_fused(type(self).__name__, "auto" if fused is None else fused)
        super().__init__(params, dict(defaults, capturable=bool(capturable)))

    def _check_args(self, lr, betas=None, **non_negative) -> None:
        """Raise for a negative ``lr`` or ``non_negative`` value, or ``betas`` outside [0, 1), naming it."""
        name = type(self).__name__
        if not (torch.is_tensor(lr) or 0.0 <= lr):
            raise ValueError(f"{name}: invalid learning rate {lr}; it must be >= 0")
        if betas is not None and not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{name}: invalid betas {betas}; each must lie in [0, 1)")
        for key, value in non_negative.items():
            if not 0.0 <= value:
                raise ValueError(f"{name}: invalid {key} value {value}; it must be >= 0")

    # Defined by subclasses:
    def _buffers(self, group: dict) -> tuple[str, ...]:
        """Names of the per-parameter state tensors shaped like the param."""
        raise NotImplementedError

    def _check_group(self, group: dict) -> None:
        """Raise for group options the kernels cannot run (the group may come from a state_dict)."""

    def _update(self, group: dict, params: list, grads: list, state: dict, masters: list,
                grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
                sr: Optional[tuple[int, int]] = None) -> None:
        """Update one bucket (one device, one param dtype); ``state[name]`` are lists; ``sr`` = (seed,
        tensor_offset) when the bucket's bf16 params are written with stochastic rounding."""
        raise NotImplementedError

    # Param groups:
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._prepare_group(self.param_groups[-1])

    def _validate_group(self, group: dict) -> None:
        """Fill the keys an older format lacks (with torch's values); reject what the kernels cannot run."""
        for key, value in self._format_defaults.items():
            group.setdefault(key, value)
        self._check_group(group)
        off_cuda = [p.device for p in group["params"] if not p.is_cuda] if group["capturable"] else []
        if off_cuda:
            raise ValueError(f"{type(self).__name__}: capturable=True needs CUDA params (as torch's capturable "
                             f"optimizers do), got one on {off_cuda[0]}; use capturable=False on the CPU")

    def _prepare_group(self, group: dict) -> None:
        """Validate the group; for ``capturable`` groups keep ``lr`` as a float32 tensor on the params' device."""
        self._validate_group(group)
        if not group["capturable"]:
            return
        device = group["params"][0].device if group["params"] else None
        lr = group["lr"]
        if device is not None and not (torch.is_tensor(lr) and lr.device == device and lr.dtype == torch.float32):
            # A schedule updates a tensor lr in place (torch's LRScheduler fills it), so a
            # captured graph or a compiled step reads each new value without a recapture.
            group["lr"] = torch.full((), float(lr), dtype=torch.float32, device=device)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._instance_attrs})
        return state

    def __setstate__(self, state: dict) -> None:
        """Also the last part of torch's load_state_dict: groups and steps of older
        formats are brought up to date here."""
        super().__setstate__(state)
        for name, default in self._instance_attrs.items():
            self.__dict__.setdefault(name, default)
        for group in self.param_groups:
            self._prepare_group(group)
        normalize_steps(self)

    # Master weights:
    def uses_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated through an fp32 master copy kept in the state."""
        return self.master_weights and p.dtype in HALF_DTYPES

    def master_param(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 weights that ``p`` is updated from: the master (state['master_param'], created from ``p`` if
        missing) when ``p`` is half and master_weights=True, else ``p`` itself. The precision engine copies exact fp32
        weights into it after halving a model, and reads it for fp32 checkpoints."""
        if not self.uses_master(p):
            return p
        st = self.state[p]
        if "master_param" not in st:
            st["master_param"] = p.detach().to(torch.float32, copy=True)
        return st["master_param"]

    @torch.no_grad()
    def enable_master_weights(self) -> None:
        """Switch to fp32 master weights (the ``*-master`` precisions call this): every fp16/bf16 param gets its master
        now, from its current value, and existing moments become fp32."""
        self.master_weights = True
        for group in self.param_groups:
            for p in group["params"]:
                if self.uses_master(p):
                    self.master_param(p)
                    st = self.state[p]
                    st.update({name: st[name].float() for name in self._buffers(group) if name in st})

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

    # Stochastic rounding (the bf16-sr precision):
    def uses_stochastic_rounding(self, p: torch.Tensor) -> bool:
        """Whether ``p`` (bf16, no master) is written with stochastic rounding at each step."""
        return self.stochastic_rounding is not None and p.dtype == torch.bfloat16 and not self.uses_master(p)

    def state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of ``p``'s moments / momentum: fp32 with a master or stochastic rounding, else ``p``'s."""
        return torch.float32 if self.uses_master(p) or self.uses_stochastic_rounding(p) else p.dtype

    @torch.no_grad()
    def enable_stochastic_rounding(self, seed: int) -> None:
        """Step bf16 params without masters, writing each new weight with stochastic rounding (the ``bf16-sr``
        precision calls this): the update is computed in fp32 from the bf16 weight and fp32 moments, and
        rounded from Philox bits keyed by ``(seed, step)`` with counter (tensor, element) (see
        :func:`mptrain.ops.stochastic_round`): reproducible from the seed, identical on every rank that
        shares it. Existing bf16 moments become fp32. Other dtypes step as before."""
        if self.master_weights:
            raise ValueError(f"{type(self).__name__}: stochastic rounding replaces master weights; "
                             "call disable_master_weights() first")
        self.stochastic_rounding = int(seed) & 0xFFFFFFFFFFFFFFFF
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and self.uses_stochastic_rounding(p):
                    st.update({name: st[name].float() for name in self._buffers(group) if name in st})

    def disable_stochastic_rounding(self) -> None:
        """Back to round-to-nearest writes (the late switch to fp32); the fp32 moments stay."""
        self.stochastic_rounding = None

    def _sr_offset(self, index: int) -> int:
        """Tensor id of the first param of group ``index``: the params before it in the optimizer."""
        return sum(len(g["params"]) for g in self.param_groups[:index])

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        self.master_param(p)  # creates the master if p needs one
        dtype = self.state_dtype(p)
        for name in self._buffers(group):
            if name not in st:
                st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *,
             grad_scale: Optional[Union[torch.Tensor, float]] = None, found_inf: Optional[torch.Tensor] = None,
             unscale_grads: bool = True):
        """One optimizer step; see :mod:`mptrain.optim` for ``grad_scale`` / ``found_inf``.
        ``unscale_grads=False`` leaves the grads scaled (saves one pass over them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf, check = scaling_inputs(self, grad_scale, found_inf)
        buckets = self._buckets()
        if not buckets:
            return loss
        per_device_inf = found_inf_per_device(buckets, found_inf, check, self.fused)
        for (index, device, _dtype, master), params in buckets.items():
            sr = None
            if self.stochastic_rounding is not None and self.uses_stochastic_rounding(params[0]):
                sr = (self.stochastic_rounding, self._sr_offset(index))
            self._step_bucket(self.param_groups[index], device, master, params, grad_scale,
                              per_device_inf.get(device), sr)
        if unscale_grads and grad_scale is not None and (torch.is_tensor(grad_scale) or grad_scale != 1):
            unscale_grads_(buckets, grad_scale, per_device_inf, self.fused)
        return loss

    def _step_bucket(self, group: dict, device: torch.device, master: bool, params: list, grad_scale,
                     found_inf: Optional[torch.Tensor], sr: Optional[tuple[int, int]] = None) -> None:
        states = [self._init_state(p, group) for p in params]
        work, grads, write_back = dense_work_lists(params, [p.grad for p in params])
        state = {name: [st[name] for st in states] for name in ("step",) + self._buffers(group)}
        masters = [st["master_param"] for st in states] if master else []
        gs = grad_scale.to(device, non_blocking=True) if torch.is_tensor(grad_scale) else grad_scale
        self._update(group, work, grads, state, masters, gs, found_inf, **({"sr": sr} if sr else {}))
        for p, w in write_back:  # the non-dense params' working copies
            p.copy_(w)

    def _buckets(self) -> dict:
        """(group index, device, dtype, master) -> params with a grad, in parameter order.
        (Plain hashable keys: torch.compile traces this on every step.)"""
        out: dict = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                key = (index, p.device, p.dtype, self.uses_master(p))
                out.setdefault(key, []).append(p)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, for every torch.optim format (see :mod:`.torch_format`): groups
        are checked before anything changes, state tensors keep the kernels' dtypes."""
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            self._validate_group(dict(saved, params=group["params"]))
        saved_state = {pid: dict(st) for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        restore_state_tensors(self, saved_state, state_dict["param_groups"])
