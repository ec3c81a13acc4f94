"""The fused kernels as custom ops ``torch.ops.mptrain.*`` (:mod:`mptrain.ops.library`), and one Python
function per op that calls it or the pure-PyTorch reference (:mod:`mptrain.ops.reference`), as
:mod:`mptrain.ops.dispatch` decides from ``fused``. Imports only torch and the built extension (DESIGN §1).
"""
from __future__ import annotations

from . import library  # noqa: F401  (defines torch.ops.mptrain.* before anything uses them)
from .layer_norm import layer_norm, rms_norm  # noqa: F401  (these names shadow the submodule ops.layer_norm)
from .lstm import lstm_cell, lstm_layer  # noqa: F401
from .multi_tensor import (multi_tensor_adam, multi_tensor_check_finite_, multi_tensor_copy_,  # noqa: F401
                           multi_tensor_l2norm, multi_tensor_lamb, multi_tensor_scale_, multi_tensor_sgd,
                           multi_tensor_unscale_, stochastic_round)
from .pool import max_pool2d  # noqa: F401
from .softmax import scaled_masked_softmax  # noqa: F401


def __getattr__(name):
    """``get_extension`` / ``extension_status`` from :mod:`mptrain.ops.build`, imported on first use: importing
    it with the package would make ``python -m mptrain.ops.build`` warn that it was imported before it ran."""
    if name in ("get_extension", "extension_status"):
        from . import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
