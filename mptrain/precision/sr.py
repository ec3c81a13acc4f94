"""``bf16-sr``: bf16 parameters without an fp32 master copy; the optimizer step rounds stochastically.

Norm layers keep fp32 weights and the fp32-fallback ops compute in fp32, as in ``bf16-master``; every other
floating parameter is bf16, and there is no loss scaler.  The optimizer keeps fp32 moments and computes each
update in fp32 from the bf16 weight; the fused kernel writes the new weight to bf16 with *stochastic rounding*
(csrc/stochastic_round.cuh): rounded up with probability equal to the distance to the lower bf16 value in ulps,
so the expected weight is the fp32 result.  An update smaller than half a bf16 ulp, which round-to-nearest
(``bf16-true``) drops every time, moves the weight in expectation.  It saves the 4 bytes per parameter of the
fp32 master (4.8 GB on a 1.2B model), and the AdamW step moves 22 bytes per parameter instead of the master
step's 28.

The random bits come from Philox-4x32-10 keyed by (seed, step) with counter (tensor, element): a run is
reproducible from its seed, every DDP rank (the seed is broadcast from rank 0) rounds identically so the replicas
never drift, and a checkpoint holds the generator's position -- the seed in this plugin's state, the step in each
parameter's optimizer step count -- so a resume continues bitwise.

Optimizers: mptrain's ``FusedAdam``, ``FusedAdamW``, ``FusedSGD``, ``FusedLAMB``, and torch's ``Adam``, ``AdamW``
and ``SGD`` (any ``fused`` / ``foreach`` setting; no ``amsgrad``, no ``differentiable``, no step hooks), which
become their fused counterpart in place (precision/fused_step.py: same update, arguments, state keys and
state_dict format).  Any other optimizer is refused at setup: it would round its bf16 update to nearest, which is
``bf16-true``.  Checkpoints hold the bf16 weights (exactly what trains) and the fp32 moments.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from mptrain.optim import FusedAdam, FusedLAMB, FusedSGD
from mptrain.precision import grads as G
from mptrain.precision.fallback import half_params_fp32_norms
from mptrain.precision.fused_step import take_over_step
from mptrain.precision.plugin import MptrainPrecision

#: mptrain's optimizers whose kernels round stochastically (torch's Adam, AdamW and SGD become one of them)
SR_OPTIMIZERS = (FusedAdam, FusedSGD, FusedLAMB)
_SUPPORTED = ("torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD (without amsgrad or differentiable, no step "
              "hooks) and mptrain.optim.FusedAdam, FusedAdamW, FusedSGD, FusedLAMB")
# Each optimizer after the first gets its own stream (tensor ids restart at 0 in each): seed + k * golden ratio.
_SEED_STRIDE = 0x9E3779B97F4A7C15


class StochasticRoundingPrecision(MptrainPrecision):
    """The ``bf16-sr`` mode; see the module docstring.

    Args:
        precision: ``"bf16-sr"``.
        seed: the rounding stream's seed (any integer, 64 bits used). ``None``: the run's seed
            (``seed_everything``'s ``PL_GLOBAL_SEED``), else 0. Under DDP rank 0's value is used on every rank.
        fp32_fallback, fused, max_consecutive_skips: as :class:`MptrainPrecision` (no loss scaler in this mode).
    """

    MODES = {"bf16-sr": torch.bfloat16}
    SCALER_ALLOWED = False
    RELEASES_CONSUMED_GRADS = True

    def __init__(self, precision: str = "bf16-sr", *, seed: Optional[int] = None, **kwargs: Any):
        super().__init__(precision, **kwargs)
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"StochasticRoundingPrecision: seed must be an int or None, got {seed!r}")
        self._seed_arg = seed
        self.seed: Optional[int] = None  # resolved at the first optimizer (or loaded from a checkpoint)
        self._converted: set[int] = set()  # ids of modules already converted

    # -- module -----------------------------------------------------------------------------
    def _convert(self, module: nn.Module) -> nn.Module:
        if id(module) in self._converted:
            return module  # validate/test after fit set the module up again
        self._converted.add(id(module))
        self._hooks += half_params_fp32_norms(module, self.param_dtype)
        return module

    def promote_module(self, module: nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters():
                p.data = p.data.float()  # its optimizer state is fp32 already; it leaves the rounded bucket
        super().promote_module(module)

    # -- optimizers -------------------------------------------------------------------------
    def _resolve_seed(self) -> int:
        """The seed, fixed at the first optimizer: the argument, else the run's seed, else 0; rank 0's everywhere."""
        if self.seed is not None:
            return self.seed
        seed = self._seed_arg
        if seed is None:
            env = os.environ.get("PL_GLOBAL_SEED")
            seed = int(env) if env else 0
        seed &= 0xFFFFFFFFFFFFFFFF
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = self._device()
            if dist.get_backend() == "nccl" and device.type != "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            # int64 carries the 64 bits (as the signed value): every rank rounds with rank 0's stream
            t = torch.tensor([seed - 2 ** 64 if seed >= 2 ** 63 else seed], dtype=torch.int64, device=device)
            dist.broadcast(t, 0)
            seed = int(t.item()) & 0xFFFFFFFFFFFFFFFF
        self.seed = seed
        return seed

    def _optimizer_seed(self, k: int) -> int:
        return (self._resolve_seed() + k * _SEED_STRIDE) & 0xFFFFFFFFFFFFFFFF

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not G.is_mptrain_fused(optimizer):
            take_over_step(optimizer, self.fused, require_fused=False)  # fused=False: the reference step
        if not isinstance(optimizer, SR_OPTIMIZERS):
            cls = type(optimizer)
            public = getattr(torch.optim, cls.__qualname__, None) is cls  # torch.optim.RMSprop, not .rmsprop.RMSprop
            name = f"torch.optim.{cls.__qualname__}" if public else f"{cls.__module__}.{cls.__qualname__}"
            why = ""
            if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
                why = (" (this one has an option the fused kernels do not run -- amsgrad, differentiable -- step "
                       "hooks, or state already)")
            raise ValueError(f"precision='bf16-sr' rounds the weight stochastically inside mptrain's fused optimizer "
                             f"step, which {name} does not take{why}. Use {_SUPPORTED}; or precision='bf16-master' "
                             f"for any optimizer")
        if optimizer.master_weights:
            for st in optimizer.state.values():
                st.pop("master_param", None)
            optimizer.master_weights = False  # the bf16 param itself is the weight in this mode
        optimizer.enable_stochastic_rounding(self._optimizer_seed(len(self._optimizers)))

    def _to_fp32(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, SR_OPTIMIZERS):
            optimizer.disable_stochastic_rounding()  # fp32 params from here on; the fp32 moments stay
        super()._to_fp32(model, optimizer)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Also the generator's seed; its step is each parameter's step count in the optimizer state."""
        return {**super().state_dict(), "sr_seed": self.seed if self.seed is not None else self._resolve_seed()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        seed = state_dict.get("sr_seed")
        if seed is None:
            return
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF  # the saved run's stream, whatever this run's seed
        for k, opt in enumerate(self._optimizers):
            if isinstance(opt, SR_OPTIMIZERS) and opt.stochastic_rounding is not None:
                opt.enable_stochastic_rounding(self._optimizer_seed(k))


__all__ = ["StochasticRoundingPrecision", "SR_OPTIMIZERS"]
