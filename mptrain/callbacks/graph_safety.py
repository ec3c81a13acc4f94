"""What may not run inside a captured forward, whose Python runs once, at capture: module hooks other than
mptrain's own (device work only), ``self.log``, and torch.compile's own CUDA graphs (cudagraph trees)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from mptrain.compat import torch as compat
from mptrain.precision.graph_capture import CudaGraphError


def refuse_module_hooks(module: torch.nn.Module) -> None:
    """Module hooks run once, at capture: only mptrain's own (device-only by design) may be graphed."""
    sources = [(f"torch has a global {k[:-1].replace('_', ' ')}", hooks) for k, hooks in compat.module_hooks().items()]
    sources += [(f"module {name or '<root>'!r} has a {k[:-1].replace('_', ' ')}", hooks)
                for name, m in module.named_modules() for k, hooks in compat.module_hooks(m).items()]
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


def refuse_cudagraph_trees() -> None:
    """A model the user compiled with cudagraph trees (``mode="reduce-overhead"``) would replay their graphs
    inside ours, or skip one silently: refused (the ``compile`` argument's graphing modes are refused at setup)."""
    if torch.cuda.is_initialized() and compat.cudagraph_trees_active(torch.cuda.current_device()):
        raise CudaGraphError("cuda_graphs=True: this process runs torch.compile's own CUDA graphs (cudagraph trees: "
                             "mode='reduce-overhead' or 'max-autotune', or options={'triton.cudagraphs': True}), "
                             "which cannot be replayed inside another capture. Compile with the default mode, or "
                             "use cuda_graphs=False")
