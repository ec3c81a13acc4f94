"""torch's fused Adam, AdamW and SGD stepped by mptrain's fused master-weight kernels in the ``*-master`` modes.

With any other optimizer the master modes swap fp32 master Parameters into the param groups, copy the half
grads up into fp32 grads before the step and the masters down into the half params after it.  For the three
optimizers users reach for, mptrain's kernels do the same update in one pass that reads the half grad and
writes the half param (csrc/multi_tensor_adam.cu, multi_tensor_sgd.cu): no fp32 grad set (4 bytes per
parameter of peak memory: 0.44 GB for BERT-base, 4.8 GB for a 1.2B model) and no copies.

The optimizer object is kept and becomes its mptrain counterpart in place (``FusedAdam``, ``FusedAdamW``,
``FusedSGD``: the same update rule, arguments and state keys, plus each half param's ``master_param``), so
the user's references, LR schedulers and checkpoints keep working; ``optimizer.state_dict()`` stays in
torch's format and loads back into torch's class.  Taken over only when the user asked torch for its fused
kernel (``fused=True``: the user chose a one-kernel step, and torch keeps its ``step`` counts on the device as
ours do), with options the kernels run (no ``amsgrad``, no ``differentiable``), no step hooks (they would see
another class's step) and no state yet.  Everything else keeps the generic path.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from mptrain.compat import torch as compat
from mptrain.optim import FusedAdam, FusedAdamW, FusedSGD
from mptrain.optim.base import FusedOptimizer
from mptrain.optim.torch_format import normalize_steps

log = logging.getLogger("mptrain")

#: exact torch class -> mptrain's fused counterpart
COUNTERPARTS: dict[type, type[FusedOptimizer]] = {torch.optim.AdamW: FusedAdamW, torch.optim.Adam: FusedAdam,
                                                  torch.optim.SGD: FusedSGD}


def fused_counterpart(optimizer: torch.optim.Optimizer, require_fused: bool = True) -> Optional[type[FusedOptimizer]]:
    """The mptrain class that can take ``optimizer``'s step over, or None (see the module docstring).
    ``require_fused=False``: also when the user did not ask torch for ``fused=True`` (``bf16-sr``, which has
    no other way to step)."""
    cls = COUNTERPARTS.get(type(optimizer))
    if cls is None or optimizer.state:
        return None
    if compat.optimizer_step_hooks(optimizer):
        return None
    for g in optimizer.param_groups:
        if (require_fused and not g.get("fused")) or g.get("amsgrad") or g.get("differentiable"):
            return None
        if cls is FusedAdam and g.get("decoupled_weight_decay"):
            cls = FusedAdamW  # torch >= 2.7 spells AdamW as Adam(decoupled_weight_decay=True)
    return cls


def take_over_step(optimizer: torch.optim.Optimizer, fused, require_fused: bool = True) -> bool:
    """Turn ``optimizer`` into its fused counterpart in place (True), or leave it (False)."""
    cls = fused_counterpart(optimizer, require_fused)
    if cls is None:
        return False
    before = type(optimizer)
    optimizer.__class__ = cls
    for name, default in cls._instance_attrs.items():  # as FusedOptimizer.__init__ sets them: no master weights
        setattr(optimizer, name, default)  # (the plugin enables them with the masters' fp32 init), no rounding
    optimizer.fused = fused
    for group in optimizer.param_groups:
        group.setdefault("decoupled_weight_decay", cls is FusedAdamW)
        optimizer._prepare_group(group)
    normalize_steps(optimizer)
    compat.patch_step_function(optimizer)
    compat.rewrap_scheduler_step(optimizer)  # an LR scheduler made before wrapped the old class's step
    log.info("%s.%s steps through mptrain's fused kernel (%s: same update and state keys)",
             before.__module__, before.__qualname__, cls.__name__)
    return True
