"""``16-mixed`` and ``bf16-mixed``: fp32 parameters, autocast compute (as in Lightning); fp16 gets a
:class:`DynamicLossScaler` by default, bf16 only when asked."""
from __future__ import annotations

from typing import Any

import torch

from mptrain.precision.plugin import MptrainPrecision


class MixedPrecision(MptrainPrecision):
    """Autocast mixed precision with mptrain's scaler, fallback and non-finite guard."""

    MODES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
    SCALER_BY_DEFAULT = ("16-mixed",)
    FP32_PARAMS = True

    def __init__(self, precision: str = "bf16-mixed", **kwargs: Any):
        super().__init__(precision, **kwargs)
