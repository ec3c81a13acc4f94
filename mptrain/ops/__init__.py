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
                           multi_tensor_unscale_)
from .softmax import scaled_masked_softmax  # noqa: F401


# Wrappers, not imports: importing ops/build.py here would make `python -m mptrain.ops.build` warn that
# the module was imported before it ran.
def get_extension(required: bool = False):
    """The built extension module (built on first use), or None; see :mod:`mptrain.ops.build`."""
    from .build import get_extension as _get

    return _get(required)


def extension_status():
    """"built" / "failed" (with ``.reason`` and ``.log_path``) / "not attempted"; see :mod:`mptrain.ops.build`."""
    from .build import extension_status as _status

    return _status()
