"""``16-mixed`` and ``bf16-mixed``: fp32 parameters, autocast compute (as in Lightning).

fp16 gets a dynamic loss scaler by default; bf16 has fp32's range and does not.
"""
from __future__ import annotations

from typing import Any

import torch

from mptrain.precision.base import Precision

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class MixedPrecision(Precision):
    def __init__(self, name: str = "bf16-mixed", device="cpu", fp32_fallback: Any = "default"):
        if name not in _DTYPES:
            raise ValueError(f"MixedPrecision: precision={name!r} is not a mixed mode; valid: {sorted(_DTYPES)}")
        self.name = name
        self.compute_dtype = self.autocast_dtype = _DTYPES[name]
        self.param_dtype = torch.float32
        self.default_scaler = name == "16-mixed"
        super().__init__(device, fp32_fallback)
