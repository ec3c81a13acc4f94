"""What may not run inside a captured forward, whose Python runs once, at capture: module hooks other than
mptrain's own (device work only), ``self.log``, and torch.compile's own CUDA graphs (cudagraph trees)."""
from __future__ import annotations

import contextlib
import sys
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


def refuse_cudagraph_trees() -> None:
    """A model the user compiled with cudagraph trees (``mode="reduce-overhead"``) would replay their graphs
    inside ours, or skip one silently: refused (the ``compile`` argument's graphing modes are refused at setup)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch.cuda.is_initialized():
        return
    try:
        manager = trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    except (AttributeError, TypeError, KeyError):  # another torch's internals: nothing to see
        return
    if manager is not None:
        raise CudaGraphError("cuda_graphs=True: this process runs torch.compile's own CUDA graphs (cudagraph trees: "
                             "mode='reduce-overhead' or 'max-autotune', or options={'triton.cudagraphs': True}), "
                             "which cannot be replayed inside another capture. Compile with the default mode, or "
                             "use cuda_graphs=False")
