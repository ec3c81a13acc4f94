"""``32-true``, ``16-true``, ``bf16-true``: the whole module in one dtype, no loss scaler (as in Lightning);
the fp32-fallback ops and the non-finite guard still apply."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from mptrain.compat.lightning import default_dtype
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision.plugin import MptrainPrecision, float_state_


class TruePrecision(MptrainPrecision):
    """One dtype for params and compute."""

    MODES = {"32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16}
    SCALER_ALLOWED = False

    def __init__(self, precision: str = "32-true", **kwargs: Any):
        super().__init__(precision, **kwargs)

    def _convert(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.param_dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """As Lightning's HalfPrecision: tensors (and layers built in ``configure_model``) are created in the half
        dtype, never in fp32 first."""
        if self.param_dtype in HALF_DTYPES:
            return default_dtype(self.param_dtype)
        return super().tensor_init_context()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """As Lightning's HalfPrecision: tensors created in the forward default to the half dtype."""
        stack = super().forward_context()
        if self.param_dtype in HALF_DTYPES:
            stack.enter_context(default_dtype(self.param_dtype))
        return stack

    def promote_module(self, module: nn.Module) -> None:
        module.float()
        ids = {id(p) for p in module.parameters()}
        for opt in self._optimizers:
            for p, st in opt.state.items():
                if id(p) in ids:
                    float_state_(st)
        super().promote_module(module)
