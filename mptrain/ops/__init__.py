"""The fused kernels as custom ops ``torch.ops.mptrain.*`` (defined in
:mod:`mptrain.ops.library`: CUDA kernel, CPU reference, fake and autograd), and one
Python function per op that calls it -- or the pure-PyTorch reference in
:mod:`mptrain.ops.reference` -- as :mod:`mptrain.ops.dispatch` decides from ``fused``.

This package imports only torch and the built extension (DESIGN §1).
"""
from __future__ import annotations

from . import library  # noqa: F401  (defines torch.ops.mptrain.* before anything uses them)

# [section: build]
# Thin wrappers: importing ops/build.py here would make `python -m mptrain.ops.build`
# warn that the module was imported before it ran.
def get_extension(required: bool = False):
    """The built extension module (built on first use), or None; see :mod:`mptrain.ops.build`."""
    from .build import get_extension as _get

    return _get(required)


def extension_status():
    """"built" / "failed" (with ``.reason`` and ``.log_path``) / "not attempted"; see :mod:`mptrain.ops.build`."""
    from .build import extension_status as _status

    return _status()
# [end section: build]

# [section: multi_tensor]
from .multi_tensor import (  # noqa: E402,F401  (multi-tensor ops and optimizer steps; see ops/multi_tensor.py)
    multi_tensor_adam,
    multi_tensor_check_finite_,
    multi_tensor_copy_,
    multi_tensor_l2norm,
    multi_tensor_lamb,
    multi_tensor_scale_,
    multi_tensor_sgd,
    multi_tensor_unscale_,
)
# [end section: multi_tensor]

# [section: layer_norm]
# (binds the names layer_norm / rms_norm to the functions, shadowing the submodule name)
from .layer_norm import layer_norm, rms_norm  # noqa: E402,F401  (fused LayerNorm / RMSNorm; see ops/layer_norm.py)
# [end section: layer_norm]

# [section: softmax]
from .softmax import scaled_masked_softmax  # noqa: E402,F401  (fused scaled masked softmax; see ops/softmax.py)
# [end section: softmax]

# [section: lstm]
from .lstm import lstm_cell, lstm_layer  # noqa: E402,F401  (fused LSTM step / layer; see ops/lstm.py)
# [end section: lstm]
