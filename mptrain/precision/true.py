"""``32-true``, ``16-true``, ``bf16-true``: the whole module in one dtype (as in Lightning).

Half modes keep no fp32 copy and use no loss scaler; the listed fp32-fallback ops
still compute in fp32.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mptrain.precision._cast import cast_floating
from mptrain.precision.base import Precision

_DTYPES = {"32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16}


class TruePrecision(Precision):
    def __init__(self, name: str = "32-true", device="cpu", fp32_fallback: Any = "default"):
        if name not in _DTYPES:
            raise ValueError(f"TruePrecision: precision={name!r} is not a true mode; valid: {sorted(_DTYPES)}")
        self.name = name
        self.param_dtype = self.compute_dtype = _DTYPES[name]
        super().__init__(device, fp32_fallback)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.param_dtype)

    def convert_input(self, data: Any) -> Any:
        return cast_floating(data, self.param_dtype)

    def promote_module(self, module: nn.Module, optimizer) -> None:
        module.float()
        if optimizer is not None:
            _float_optimizer_state(optimizer, list(module.parameters()))
        super().promote_module(module, optimizer)


def _float_optimizer_state(optimizer: torch.optim.Optimizer, params: list) -> None:
    """Optimizer state of ``params`` follows them to fp32 (moments, momentum buffers)."""
    ids = {id(p) for p in params}
    for p, st in optimizer.state.items():
        if id(p) in ids:
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" and v.dim() > 0:
                    st[k] = v.float()
