"""Late-epoch fp32 fine-tuning: switch a run to ``32-true`` for its last N epochs.

Low precision gets most of the way fast; the last epochs in fp32 polish what
rounding left.  The switch keeps the optimizer state: params become fp32 (the
masters' exact values where they exist), autocast and the loss scaler go off.
"""
from __future__ import annotations

import torch
from torch import nn

from mptrain.precision.base import Precision
from mptrain.precision.master import MasterPrecision
from mptrain.precision.true import TruePrecision, _float_optimizer_state


def finetune_start_epoch(max_epochs: int, fp32_finetune_epochs: int) -> int | None:
    """The epoch that starts in fp32, or None when there is no switch."""
    if fp32_finetune_epochs <= 0:
        return None
    return max(0, max_epochs - fp32_finetune_epochs)


def switch_to_fp32(precision: Precision, module: nn.Module, optimizer: torch.optim.Optimizer) -> Precision:
    """Convert ``module`` and ``optimizer`` in place to fp32 and return the ``32-true`` precision."""
    if precision.name == "32-true":
        return precision
    if precision.auto is not None:
        precision.auto.remove()
    if isinstance(precision, MasterPrecision):
        precision.to_fp32(module, optimizer)
    else:
        module.float()
        _float_optimizer_state(optimizer, list(module.parameters()))
    for h in precision._hooks:
        h.remove()
    precision._hooks = []
    return TruePrecision("32-true", precision.device)
