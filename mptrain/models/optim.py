"""Parameter groups: no weight decay on biases and normalization weights (standard for ResNet
and BERT training; decaying them hurts accuracy)."""
from __future__ import annotations

import torch
from torch import nn

from mptrain.compat import torch as compat

_NORMS = (compat.norm_base_class(), nn.LayerNorm, nn.GroupNorm)


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for mod in module.modules():
        is_norm = isinstance(mod, _NORMS) or "norm" in type(mod).__name__.lower()
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # tied weights (embedding = output layer) once
                continue
            seen.add(id(p))
            (no_decay if is_norm or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(kind: str, module: nn.Module, weight_decay: float, **kwargs):
    """SGD or AdamW over ``decay_groups(module, weight_decay)``: mptrain's fused multi-tensor version when the params
    are on CUDA (one kernel per step; with ``*-master`` it also owns the fp32 masters), torch's otherwise (the CPU
    path of the fused classes is a reference, not tuned for speed).  ``kind``: "sgd" or "adamw" (the models check it
    when they are built)."""
    groups = decay_groups(module, weight_decay)
    if next(module.parameters()).is_cuda:
        from mptrain.optim import FusedAdamW, FusedSGD

        return (FusedSGD if kind == "sgd" else FusedAdamW)(groups, **kwargs)
    return (torch.optim.SGD if kind == "sgd" else torch.optim.AdamW)(groups, **kwargs)
