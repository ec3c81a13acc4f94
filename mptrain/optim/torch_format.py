"""torch.optim's state formats, old and new, in and out of the fused optimizers.

``step`` was once a Python number, now a tensor; param groups gained ``maximize``, ``foreach``,
``capturable``, ``differentiable``, ``fused`` and ``decoupled_weight_decay``. A state_dict of any of
them (or of ``torch.optim.Adam/AdamW/SGD``) loads here, its tensors in the kernels' dtypes and layout.
"""
from __future__ import annotations

import numbers

import torch

from .layout import state_in_layout


def step_count(value, p: torch.Tensor) -> torch.Tensor:
    """A saved ``step`` (a number, or a tensor on any device/dtype) as the float32 0-dim
    device tensor the kernels advance."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((), float(value), dtype=torch.float32, device=p.device)
    if torch.is_tensor(value) and value.numel() == 1:
        return value.detach().to(device=p.device, dtype=torch.float32).reshape(()).clone()
    raise TypeError(f"optimizer state 'step' must be a number or a one-element tensor, got {value!r:.80}")


def normalize_steps(optimizer) -> None:
    """Turn every numeric ``step`` in the state into a device tensor (old formats)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and "step" in st and not (torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32
                                             and st["step"].device == p.device and st["step"].dim() == 0):
                st["step"] = step_count(st["step"], p)


def restore_state_tensors(optimizer, saved_state: dict, saved_groups: list) -> None:
    """After torch's loader: put each state tensor back in the dtype the kernels use (torch casts to the param's dtype,
    which would turn fp32 masters and moments of half params into half) and in the param's working layout; a state
    without a step count (torch.optim.SGD's) gets count 1, since its buffers exist."""
    ids = [pid for g in saved_groups for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(ids, params):
        if pid not in saved_state:
            continue
        st = optimizer.state[p]
        for name, value in saved_state[pid].items():
            if name == "step":
                st[name] = step_count(value, p)
            elif name == "master_param" and not optimizer.uses_master(p):
                st.pop(name, None)
            elif torch.is_tensor(value):
                dtype = optimizer.state_dtype(p)
                st[name] = state_in_layout(value, p, dtype)
            elif value is None:  # torch.optim.SGD keeps momentum_buffer=None until the first step
                st.pop(name, None)
        if "step" not in st and st:
            st["step"] = torch.ones((), dtype=torch.float32, device=p.device)
