"""Sharded training (FSDP): the sharded fp32 parameters are the masters (no second fp32 copy).

FSDP's own mixed precision all-gathers half parameters for forward/backward and reduce-scatters fp32
grads into the fp32 shards, which any optimizer steps.  mptrain adds what the unsharded modes have:
the dynamic loss scaler, the unscale + inf/NaN check of the local grad shards with ``found_inf``
all-reduced (MAX) so every rank skips the same step, the non-finite guard and the fp32 op fallback.
Norm layers keep fp32 parameters through FSDP's ``_module_classes_to_ignore``, which torch honours
only with an ``auto_wrap_policy``.  Refused at setup: ``*-true`` half modes (Lightning's
``FSDPPrecision`` runs those), the late switch to fp32 and the automatic fp32 promotion.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as FabricFSDPPrecision
from lightning.fabric.utilities import rank_zero_warn
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision as FSDPMixedPrecision

from mptrain.compat import torch as compat
from mptrain.compat.lightning import default_dtype
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision import grads as G
from mptrain.precision.fallback import is_norm_module
from mptrain.precision.plugin import MptrainPrecision

#: Callbacks whose work FSDP cannot do: they change parameter dtypes after wrapping.
_REFUSED_CALLBACKS = {
    "Fp32Finetune": "FSDP fixes its mixed precision when it wraps the model, so the switch to fp32 cannot "
                    "happen mid-run. Drop fp32_finetune_epochs/steps (Fp32Finetune), or train unsharded",
    "AutoFp32Fallback": "FSDP all-gathers every parameter of a unit in one dtype, so one module cannot be "
                        "promoted to fp32 mid-run. Drop auto_fp32_fallback (AutoFp32Fallback), or list the op "
                        "in fp32_fallback",
}


class ShardedPrecision(MptrainPrecision, FSDPPrecision, FabricFSDPPrecision):
    """mptrain's precision engine for ``strategy="fsdp"``, a Lightning ``FSDPPrecision`` (Trainer and Fabric).

    Args:
        precision: ``"bf16-master"`` / ``"16-master"`` (half params all-gathered from the fp32 shards, fp32
            gradient reduction), ``"bf16-mixed"`` / ``"16-mixed"`` (the same plus autocast) or ``"32-true"``.
        norms_fp32: keep normalization layers' parameters in fp32 (needs the strategy's ``auto_wrap_policy``).
        loss_scaler, fp32_fallback, fused, max_consecutive_skips: as :class:`MptrainPrecision`.
    """

    MODES = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
             "16-master": torch.float16, "bf16-master": torch.bfloat16}
    SCALER_BY_DEFAULT = ("16-mixed", "16-master")
    FP32_PARAMS = True  # the sharded params stay fp32; FSDP casts what it all-gathers

    def __init__(self, precision: str = "bf16-master", *, norms_fp32: bool = True, **kwargs: Any):
        if precision in ("16-true", "bf16-true"):
            raise ValueError(f"ShardedPrecision(precision={precision!r}) is not supported: with FSDP the sharded "
                             f"parameters are the fp32 masters. Valid values: {', '.join(map(repr, self.MODES))}; "
                             f"Lightning's own FSDPPrecision({precision!r}) shards half parameters")
        if not isinstance(norms_fp32, bool):
            raise ValueError(f"norms_fp32={norms_fp32!r} is not valid; valid values: True, False")
        MptrainPrecision.__init__(self, precision, **kwargs)
        self.norms_fp32 = norms_fp32
        self.scaler = None  # FSDPPrecision's ShardedGradScaler: mptrain's DynamicLossScaler replaces it
        self._desired_input_dtype = torch.float32  # modules are created (and sharded) in fp32
        self._norm_classes: tuple[type, ...] = ()
        self._root: Optional[nn.Module] = None

    @property
    def has_master_weights(self) -> bool:  # the fp32 shards are the masters
        return self.precision.endswith("-master")

    def module_init_context(self):
        """Modules are created in fp32: the shards are the masters.  (Lightning 2.6.0's FSDPPrecision
        creates them in the all-gather dtype, ``mixed_precision_config.param_dtype``; later versions in
        ``_desired_input_dtype``.)"""
        return default_dtype(torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Before wrapping: parameters stay fp32 (FSDP shards them); the norm classes are noted."""
        self._module = module
        if self.norms_fp32 and self.compute_dtype in HALF_DTYPES:
            self._norm_classes = tuple(sorted({type(m) for m in module.modules() if is_norm_module(m)},
                                              key=lambda t: t.__qualname__))
        return module

    @property
    def mixed_precision_config(self) -> Optional[FSDPMixedPrecision]:
        """What FSDP casts: half all-gathered params and buffers, fp32 reduction; None in ``32-true``."""
        if self.compute_dtype not in HALF_DTYPES:
            return None
        return FSDPMixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=torch.float32,
                                  buffer_dtype=self.compute_dtype, _module_classes_to_ignore=self._norm_classes)

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Setup: the model must be FSDP-wrapped with this plugin's mixed precision."""
        if not isinstance(model, FullyShardedDataParallel):
            raise ValueError(f"{self!r} runs under strategy='fsdp' (Lightning's FSDPStrategy), but the model is a "
                             f"{type(model).__name__}. Use strategy='fsdp', or mptrain.MasterPrecision / "
                             f"mptrain.precision_plugin({self.initial_precision!r}) for unsharded training")
        self._check_wrapped_precision(model)
        self._check_callbacks(getattr(model, "module", model))
        self._warn_if_norms_half(model)
        self._root = model
        return super().connect(model, optimizers, lr_schedulers)

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Fabric never calls ``connect``: its first step checks that the optimizer holds FSDP's shards
        (flat parameters, or with ``use_orig_params`` views into them)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self._root is None and not all(map(compat.is_fsdp_flattened, params)):
            raise ValueError(f"{self!r} runs under Lightning's FSDPStrategy, but {type(optimizer).__name__} holds "
                             f"parameters FSDP does not manage. Use strategy='fsdp' and set up the module before "
                             f"the optimizer, or mptrain.MasterPrecision({self.initial_precision!r}) unsharded")

    def _check_wrapped_precision(self, model: nn.Module) -> None:
        """A ``FSDPStrategy(mixed_precision=...)`` of the user's own would silently override the mode."""
        wanted = self.mixed_precision_config
        got = getattr(model, "mixed_precision", None)
        pair = (lambda mp: (getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None)))
        if pair(got) != pair(wanted):
            raise ValueError(f"the FSDP model was wrapped with mixed_precision={got}, but {self!r} needs "
                             f"param_dtype={pair(wanted)[0]}, reduce_dtype={pair(wanted)[1]}. Drop "
                             f"FSDPStrategy(mixed_precision=...): the precision plugin sets it")

    def _warn_if_norms_half(self, model: nn.Module) -> None:
        """torch honours ``_module_classes_to_ignore`` only with an ``auto_wrap_policy``: say so once."""
        if not self._norm_classes:
            return
        units = [m.module for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        if not any(isinstance(u, self._norm_classes) for u in units):
            rank_zero_warn(f"{self!r}: the norm layers ({', '.join(c.__name__ for c in self._norm_classes)}) run "
                           f"with half weights: FSDP keeps them fp32 only with an auto_wrap_policy, e.g. "
                           f"FSDPStrategy(auto_wrap_policy={{<your transformer block class>}})")

    def _check_callbacks(self, module: nn.Module) -> None:
        trainer = getattr(module, "_trainer", None)
        for cb in getattr(trainer, "callbacks", None) or []:
            reason = _REFUSED_CALLBACKS.get(type(cb).__name__)
            if reason is not None:
                raise ValueError(f"{type(cb).__name__} cannot run with {self!r}: {reason}")

    def enable_auto_fallback(self, module: nn.Module) -> None:
        raise ValueError(f"auto_fp32_fallback cannot run with {self!r}: {_REFUSED_CALLBACKS['AutoFp32Fallback']}")

    def switch_to_fp32(self, model: nn.Module, optimizers: list) -> None:
        raise ValueError(f"the switch to fp32 cannot run with {self!r}: {_REFUSED_CALLBACKS['Fp32Finetune']}")

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: Any = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clip the unscaled fp32 grad shards; the norm is the full model's (FSDP reduces it across ranks)."""
        if self._root is None or gradient_clip_algorithm == GradClipAlgorithmType.VALUE or not clip_val or clip_val < 0:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        self.unscale_and_check(self.prepare_optimizer(optimizer))
        self._root.clip_grad_norm_(clip_val)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Non-finite weights are written as Lightning writes them, with a warning decided on every rank together (a
        full state dict lives on rank 0 only, a sharded one is split across ranks): one all-reduce per checkpoint."""
        local = [_local(v) for v in checkpoint.get("state_dict", {}).values()]
        floats = [t for t in local if t is not None and t.is_floating_point() and t.numel()]
        bad = torch.zeros(1, device=self._device())
        if floats:
            bad = (~torch.stack([torch.isfinite(t).all() for t in floats]).all()).float().reshape(1).to(bad.device)
        G.all_reduce_max_(bad)
        if not bool(bad.item()):
            return
        rank_zero_warn(f"saving a checkpoint with a weight holding inf/NaN at step {self._step_number()} "
                       f"(precision={self.precision!r}): resuming it trains on from inf/NaN; an earlier checkpoint "
                       f"may be the last good one")


def _local(value: Any) -> Optional[torch.Tensor]:
    """The part of a state-dict value this rank holds: a DTensor's / ShardedTensor's local shard."""
    if not isinstance(value, torch.Tensor):
        return None
    if hasattr(value, "to_local"):  # DTensor
        return value.to_local()
    if hasattr(value, "local_shards"):  # ShardedTensor (FSDP1 sharded state dict)
        shards = [s.tensor.reshape(-1) for s in value.local_shards()]
        return torch.cat(shards) if shards else None
    return value


def is_sharded_strategy(strategy: Any) -> bool:
    """``strategy`` (a name or an instance) is Lightning's FSDP strategy, which needs :class:`ShardedPrecision`."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, str):
        return strategy in FSDPStrategy.get_registered_strategies()
    return isinstance(strategy, FSDPStrategy)


__all__ = ["ShardedPrecision", "is_sharded_strategy"]
