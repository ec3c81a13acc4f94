"""The one kernel-or-reference decision of :mod:`mptrain.ops`, from the ``fused`` switch:

* ``False``: the pure-PyTorch reference, called directly (differentiable twice, forward-mode AD, any dtype);
* ``"auto"``: on the CPU the reference directly in eager mode (the op's CPU kernel is the same code behind
  20-60 µs of dispatcher and Python autograd) and the op under ``torch.compile`` (a compiled graph holds
  ``mptrain.*`` nodes on every device); on CUDA the op for float32/float16/bfloat16 once the extension
  has loaded, else the reference (one warning per process when it cannot be built);
* ``True``: the CUDA kernel, else a clear error.
"""
from __future__ import annotations

import torch

from mptrain.compat import torch as compat

FUSED_CHOICES = ("auto", True, False)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Whether the CUDA kernels are registered: None until the first CUDA call asks for them.
_cuda_kernels: "bool | None" = None
#: The extension's lean entry points for LayerNorm / RMSNorm and max pooling (csrc/fast_call.cpp), once it
#: has loaded.
fast_norm = fast_pool = None


def check_fused(owner: str, fused):
    """``fused`` if it is one of FUSED_CHOICES, else a ValueError naming ``owner``."""
    if fused is not True and fused is not False and fused != "auto":
        raise ValueError(f"{owner}: fused={fused!r}, expected one of {FUSED_CHOICES}")
    return fused


def _load(required: bool) -> bool:
    """Build/load the extension (which registers the CUDA kernels); False if unavailable."""
    global _cuda_kernels, fast_norm, fast_pool
    from .build import get_extension  # lazily: torch.utils.cpp_extension is slow to import

    ext = get_extension(required=required)
    _cuda_kernels = ext is not None
    fast_norm, fast_pool = getattr(ext, "norm", None), getattr(ext, "max_pool2d", None)
    return _cuda_kernels


def call_fast(entry: str, x, fused, *args):
    """The lean entry point ``entry`` ("fast_norm" or "fast_pool") called on ``(x, *args)`` for an eager call
    on a CUDA tensor with ``fused`` True or "auto"; NotImplemented otherwise, and wherever the entry point
    declines (the caller then takes the ``torch.ops`` path).  Compiled code never calls it: the graph holds
    the op (the entry point is looked up by name after that test, so tracing never touches it)."""
    if torch.compiler.is_compiling() or not x.is_cuda or not (fused is True or fused == "auto"):
        return NotImplemented
    fn = globals()[entry]
    return NotImplemented if fn is None else fn(x, *args)


# torch.compile runs the loader while tracing and treats its answer as a constant
compat.mark_compile_constant(_load)


def use_op(op: str, x: torch.Tensor, fused, dtype=None) -> bool:
    """True: call ``torch.ops.mptrain.<op>``; False: call the reference directly. ``dtype``: the dtype the op will run
    in when not ``x``'s (autocast casts first)."""
    if fused is False:
        return False
    if not x.is_cuda:
        if fused is True:
            raise RuntimeError(f"{op}: fused=True needs CUDA tensors, got {x.dtype} on {x.device}; "
                               "use fused='auto' to fall back to the reference")
        check_fused(op, fused)
        return torch.compiler.is_compiling()
    if (dtype or x.dtype) not in KERNEL_DTYPES:
        if fused is True:
            raise TypeError(f"{op}: fused=True needs float32/float16/bfloat16 input, got {dtype or x.dtype}; "
                            "use fused='auto' to fall back to the reference")
        check_fused(op, fused)
        return False
    if _cuda_kernels is not None and (fused == "auto" or (fused is True and _cuda_kernels)):
        return _cuda_kernels
    check_fused(op, fused)
    return _load(fused is True)
