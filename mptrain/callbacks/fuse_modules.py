"""FuseModules (``Trainer(fuse_modules="auto")``): mptrain's fused drop-ins swapped into a user's own model at setup.

Any LightningModule, whatever attribute its network lives in: exact ``nn.LayerNorm`` / ``nn.RMSNorm`` /
``nn.MaxPool2d`` modules and large ragged-width ``nn.Linear`` layers (vocabulary projections) become
``FusedLayerNorm`` / ``FusedRMSNorm`` / ``FusedMaxPool2d`` / ``PaddedLinear`` in place, each only where it was
measured faster for the way it runs (``mptrain.nn.fuse.MEASURED_FASTER``: eager, or under ``torch.compile``,
which keeps its own norms).  Only the class of each module changes: Parameter objects (an optimizer's state),
state-dict keys, hooks and weight tying stay.  One log line lists the swaps.

It runs in ``setup``: after the module's ``__init__`` and before ``configure_model`` (a network built there is
not seen), the precision plugin's conversion, the optimizers, ``CompileModel`` (listed after it) and DDP.
Modules that are already mptrain's (a recipe model that called ``fuse_modules`` itself) are left as they are.
"""
from __future__ import annotations

from typing import Union

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from mptrain.callbacks.compile_model import CompileModel
from mptrain.compat import torch as compat
from mptrain.nn.fuse import MEASURED_FASTER, count_fused, describe_swaps, fuse_and_list, kernels_available
from mptrain.precision import HALF_DTYPES, MptrainPrecision

#: Lightning's own precision strings that compute in 16 bits
_LIGHTNING_HALF = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")


def check_fuse_mode(value, owner: str = "fuse_modules") -> None:
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"{owner}={value!r} is not valid; valid values: 'auto', True, False")


class FuseModules(Callback):
    """Swap mptrain's fused modules into the LightningModule at ``setup``; see the module docstring.

    Args:
        mode: ``"auto"``: on where mptrain's CUDA kernels run -- a CUDA device, a 16-bit mode (``*-mixed``,
            ``*-true``, ``*-master``, ``fp8-master``) and ``fused`` not False -- and the kernels load; ``True``:
            on in every mode and on every device (on the CPU the modules run PyTorch's own ops); ``False``: off.
    """

    def __init__(self, mode: Union[str, bool] = "auto") -> None:
        check_fuse_mode(mode, "FuseModules(mode)")
        self.mode = mode
        self.swapped: list = []  # the Swaps of the last setup
        self.off_reason = None  # why the last setup swapped nothing, when it did not run
        self._logged: set[int] = set()  # ids of the modules whose line was logged

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.swapped, self.off_reason = [], self._why_off(trainer)
        if self.off_reason is not None:  # silent: "auto" is off wherever mptrain's kernels do not run
            return
        compiled = _compiled_roots(trainer, pl_module)
        for name, root in compiled:
            self.swapped += fuse_and_list(root, MEASURED_FASTER["compiled"], prefix=name)[1]
        self.swapped += fuse_and_list(pl_module, MEASURED_FASTER["eager"], skip=[m for _, m in compiled])[1]
        if self.swapped or id(pl_module) not in self._logged:  # a later stage's setup finds them swapped
            rank_zero_info(f"mptrain: fused modules: {self._summary(pl_module, compiled)}")
            self._logged.add(id(pl_module))

    def _why_off(self, trainer):
        """None when the swap runs, else why not (``"auto"`` only; ``True`` runs wherever it can)."""
        plugin = trainer.precision_plugin
        fused = getattr(plugin, "fused", "auto")
        if self.mode is False:
            return "fuse_modules=False"
        if self.mode is True:
            if fused is False:
                raise ValueError(f"fuse_modules=True swaps in mptrain's fused modules, but the precision plugin "
                                 f"{plugin!r} has fused=False (PyTorch only): drop one of them")
            return None
        if fused is False:
            return "fused=False"
        if not _is_half(plugin):
            return f"precision {getattr(plugin, 'precision', type(plugin).__name__)!r} (measured in 16 bits only)"
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return f"the run trains on {device} (mptrain's kernels are CUDA kernels)"
        if not kernels_available():  # warns once, with the reason
            return "mptrain's CUDA extension is unavailable"
        return None

    def _summary(self, pl_module, compiled) -> str:
        if self.swapped:
            text = describe_swaps(self.swapped)
        else:
            own = count_fused(pl_module)
            text = "none swapped" + (f" (the model's own: {', '.join(f'{n} {c}' for c, n in own.items())})"
                                     if own else "")
        kept = sum(type(m) in (nn.LayerNorm, nn.RMSNorm) for _, root in compiled for m in root.modules())
        if kept:
            text += f"; {kept} LayerNorm/RMSNorm left to torch.compile ({', '.join(n for n, _ in compiled)})"
        return text


def _is_half(plugin) -> bool:
    if isinstance(plugin, MptrainPrecision):
        return plugin.compute_dtype in HALF_DTYPES
    return str(getattr(plugin, "precision", "")) in _LIGHTNING_HALF


def _compiled_roots(trainer, pl_module) -> list:
    """(name, module) of the outermost submodules that will run compiled: ``model`` under ``CompileModel``, and any
    the user compiled (``Module.compile()``, or a ``torch.compile`` wrapper stored as an attribute)."""
    will_compile = any(isinstance(c, CompileModel) for c in trainer.callbacks)
    roots = []
    for name, m in pl_module.named_modules():
        if any(name.startswith(f"{r}.") or r == "" for r, _ in roots):
            continue
        user = compat.compiled_call(m) is not None or compat.is_optimized_module(m)
        if user or (will_compile and name == "model"):
            roots.append((name, m))
    return roots
