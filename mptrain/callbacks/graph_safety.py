"""What may not run inside a captured forward: its Python runs once, at capture, never again.

Module hooks are Python: only mptrain's own, which do device work only (the fp32 fallback's casts,
OverflowMonitor's counters), may be graphed.  ``self.log`` in forward would log only at capture.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from mptrain.precision.graph_capture import CudaGraphError


def refuse_module_hooks(module: torch.nn.Module) -> None:
    """Module hooks run once, at capture: only mptrain's own (device-only by design) may be graphed."""
    from torch.nn.modules import module as torch_module

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    sources = [(f"torch has a global {k[1:-1].replace('_', ' ')}", getattr(torch_module, f"_global{k}", {}))
               for k in kinds]
    sources += [(f"module {name or '<root>'!r} has a {k[1:-1].replace('_', ' ')}", getattr(m, k))
                for name, m in module.named_modules() for k in kinds]
    for where, hooks in sources:
        for hook in hooks.values():
            fn = getattr(hook, "func", hook)
            if not getattr(fn, "__module__", "").startswith("mptrain."):
                raise CudaGraphError(f"cuda_graphs=True: {where} ({getattr(fn, '__qualname__', fn)}); module hooks "
                                     "would run once, at capture, not every step. Remove the hook or use "
                                     "cuda_graphs=False")


@contextlib.contextmanager
def refuse_logging(module: torch.nn.Module):
    """``self.log`` inside a captured forward would log once, at capture: refuse it."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise CudaGraphError("cuda_graphs=True: forward calls self.log, which would log only at capture; log "
                             "in training_step instead")
    module.log = module.log_dict = refuse
    try:
        yield
    finally:
        del module.log, module.log_dict
