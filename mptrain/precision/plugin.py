"""The shared core of every mode: one Lightning precision plugin for ``lightning.Trainer`` and ``lightning.Fabric``.

``lightning.Trainer`` calls ``connect`` at setup and ``optimizer_step(optimizer, model=..., closure=...)``
once per accumulation window; ``lightning.Fabric`` never connects and calls ``backward(loss, module)``,
``optimizer_step(optimizer)`` without a closure and ``unscale_gradients`` + ``main_params`` from
``clip_gradients`` (optimizers are prepared on first use).  In the step, grads are copied up (``*-master``),
unscaled and checked for inf/NaN on the device (the loss too), the flag is agreed across ranks, clipping
sees unscaled grads and the skip happens on the device: no host sync with optimizers that honour
``found_inf`` in the kernel, one read of the flag with any other (as with torch's GradScaler).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision as _LightningPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import nn

from mptrain import ops
from mptrain.compat.lightning import after_closure, convert_fp_tensor
from mptrain.nn.sdpa_masks import skip_trivial_masks
from mptrain.ops.dispatch import check_fused
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision import grads as G
from mptrain.precision.fallback import AutoFallback, Fp32Fallback, run_module_in_fp32
from mptrain.precision.loss_scaler import DynamicLossScaler, NonFiniteError
from mptrain.precision.mode_change import check_mode_change, saved_mode
from mptrain.precision.nonfinite import NonFiniteGuard
from mptrain.precision.sdpa_backend import parse_sdpa
from mptrain.precision.sdpa_backend import priority_context as sdpa_priority_context
from mptrain.precision.sdpa_backend import resolve as sdpa_resolve

log = logging.getLogger("mptrain")


class StepCheck(NamedTuple):
    """What :meth:`MptrainPrecision.unscale_and_check` decided for one optimizer's step: device tensors that the
    later phases read (a step runner that replays the check from a CUDA graph hands the refilled ones back)."""

    found_inf: torch.Tensor  # 1-element float32, nonzero: skip this step
    grad_norm: Optional[torch.Tensor] = None  # fused ``*-master`` path: norm of the unscaled grads
    max_norm: Optional[float] = None  # fused ``*-master`` path: clipping that ``before_step`` folded into the step


class MptrainPrecision(_LightningPrecision):
    """Base of :class:`MasterPrecision`, :class:`MixedPrecision` and :class:`TruePrecision`.

    Step phases: ``optimizer_step`` is composed of these public methods, called in this order once per
    optimizer step (as torch's GradScaler exposes ``unscale_``, ``step`` and ``update``).  A step runner set as
    ``step_runner`` (``cuda_graphs=True``'s :class:`~mptrain.precision.graphed_step.GraphedStep`) takes
    ``optimizer_step`` over and drives the same phases, replaying the device ones from CUDA graphs.

    1. ``prepare_optimizer(optimizer)``: the torch optimizer inside Lightning's or Fabric's wrapper, prepared on
       first use (``*-master`` swaps in the fp32 masters).
    2. ``unscale_and_check(optimizer) -> found_inf``: grads copied up (``*-master``), unscaled and checked for
       inf/NaN together with the window's loss flag, the flag agreed across ranks; once per step (later calls,
       e.g. from clipping, return the same flag).  ``step_check`` / ``set_step_check`` read and hand back
       what it decided (:class:`StepCheck`); ``keep_loss_flag_in(buffer)`` moves the loss flag it reads into a
       buffer that stays put.
    3. ``before_step(model, optimizer)``: Lightning's ``on_before_optimizer_step`` hooks, then gradient clipping.
    4. ``apply_step(optimizer, found_inf)``: the optimizer step, skipped where ``found_inf`` is set, and the
       loss-scale update: device work only with an optimizer that honours ``found_inf`` on the device.  Under
       ``lightning.Trainer`` the plugin's own ``optimizer_step`` runs phases 2 and 3 inside ``optimizer.step``
       (Lightning's closure contract) and arms that step with the check instead; a runner, which calls the
       closure itself, calls ``apply_step``.
    5. ``finish_step(optimizer, found_inf)``: the skip counters and :class:`NonFiniteError` check, ``end_step``
       and the automatic fp32 fallback's poll.
    ``end_step(optimizer)``: the window ends (``*-master`` copies the masters down, consumed half grads go, the flags
    reset); also alone, when ``training_step`` returned None and Lightning steps nothing.

    Args:
        precision: the mode string (the subclass lists the valid ones).
        loss_scaler: ``None`` for the mode's default (DESIGN §2), ``False``/``"off"`` for none,
            a :class:`DynamicLossScaler`, or a dict of its arguments.
        fp32_fallback: ``"default"``, a list of op names (``"+name"``/``"-name"`` edit the default) or ``[]``.
        fused: mptrain's kernels where available (``"auto"``), required (``True``) or off (``False``).
        max_consecutive_skips: skipped steps in a row before :class:`NonFiniteError`;
            ``None``: the scaler's setting, else 100.
        sdpa: which ``scaled_dot_product_attention`` back end the forward prefers: ``"auto"`` (mptrain's measured
            order for the GPU), ``"torch"`` (torch's own) or a list of back-end names (:mod:`.sdpa_backend`).
    """

    MODES: dict[str, torch.dtype] = {}
    SCALER_BY_DEFAULT: tuple[str, ...] = ()
    SCALER_ALLOWED = True
    FP32_PARAMS = False  # the module keeps fp32 parameters whatever the compute dtype
    has_master_weights = False
    #: the mode's own fused step consumes the half grads: ``end_step`` releases them (see there)
    RELEASES_CONSUMED_GRADS = False

    def __init__(self, precision: str, *, loss_scaler: Any = None, fp32_fallback: Any = "default",
                 fused: Union[str, bool] = "auto", max_consecutive_skips: Optional[int] = None,
                 sdpa: Any = "auto"):
        if precision not in self.MODES:
            raise ValueError(f"{type(self).__name__}(precision={precision!r}) is not supported. "
                             f"Valid values: {', '.join(map(repr, self.MODES))}")
        self.precision = self.initial_precision = precision
        self.compute_dtype = dtype = self.MODES[precision]
        self.param_dtype = torch.float32 if self.FP32_PARAMS else dtype
        self.autocast_dtype: Optional[torch.dtype] = dtype if precision.endswith("-mixed") else None
        self.fused = check_fused(type(self).__name__, fused)
        self.sdpa = parse_sdpa(sdpa)
        self._sdpa_order: dict[torch.device, Optional[tuple[str, ...]]] = {}
        self.loss_scaler = self._build_scaler(loss_scaler)
        fallback = Fp32Fallback(fp32_fallback)  # checks the list in every mode
        self.fallback: Optional[Fp32Fallback] = fallback if dtype in HALF_DTYPES else None
        if max_consecutive_skips is None:
            max_consecutive_skips = self.loss_scaler.max_consecutive_skips if self.loss_scaler else 100
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.phase = "fp32" if dtype == torch.float32 else "low"
        self.auto: Optional[AutoFallback] = None
        self._module: Optional[nn.Module] = None
        self._optimizers: list[torch.optim.Optimizer] = []  # prepared (masters swapped in)
        self._lightning = False  # True once lightning.Trainer connected us (Fabric never does)
        self._pending: dict[int, torch.Tensor] = {}  # optimizer id -> found_inf of the step in progress
        self._loss_bad: Optional[torch.Tensor] = None  # a non-finite loss in the current window
        self._hooks: list = []
        self._promoted_names: list[str] = []
        self.step_runner: Any = None  # takes optimizer_step over when set (see the class docstring)

    def _build_scaler(self, spec: Any) -> Optional[DynamicLossScaler]:
        if spec is False or spec == "off":
            return None
        if spec is None:
            return DynamicLossScaler() if self.precision in self.SCALER_BY_DEFAULT else None
        if not self.SCALER_ALLOWED:
            raise ValueError(f"precision={self.precision!r} uses no loss scaler (as in Lightning); got loss_scaler="
                             f"{spec!r}. Use a '*-master' or '*-mixed' precision for loss scaling, or loss_scaler=None")
        return DynamicLossScaler.from_spec(spec)

    # -- public state ------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on non-finite loss/grads (one host read)."""
        return int(self.guard.total.item())

    @property
    def promoted(self) -> list[str]:
        """Modules promoted to fp32 by the automatic fallback, by name."""
        return sorted(self.auto.promoted) if self.auto is not None else list(self._promoted_names)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"

    # -- module and data -----------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        self._module = module
        if self.phase == "fp32" and self.precision != self.initial_precision:
            return module.float()
        return self._convert(module)

    def _convert(self, module: nn.Module) -> nn.Module:
        return module

    def _device(self) -> torch.device:
        p = next(self._module.parameters(), None) if self._module is not None else None
        return p.device if p is not None else torch.device("cpu")

    def convert_input(self, data: Any) -> Any:
        if self.param_dtype not in HALF_DTYPES:
            return data
        return apply_to_collection(data, torch.Tensor, convert_fp_tensor, self.param_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast (``*-mixed``), the fp32 fallback of listed ops and the attention back-end priority, around
        every forward."""
        stack = contextlib.ExitStack()
        device = self._device()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device.type, dtype=self.autocast_dtype))
        if device not in self._sdpa_order:
            self._sdpa_order[device] = sdpa_resolve(self.sdpa, device)
        stack.enter_context(sdpa_priority_context(self._sdpa_order[device]))
        if self.sdpa != "torch":
            stack.enter_context(skip_trivial_masks())
        if self.fallback is not None:
            stack.enter_context(self.fallback.context())
        return stack

    # -- backward -------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        return super().pre_backward(tensor, module) if self._lightning else tensor

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        return super().post_backward(tensor, module) if self._lightning else tensor

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """Scale the loss and backpropagate; a non-finite loss marks the window for skipping (on the device)."""
        bad = (~torch.isfinite(tensor.detach())).any().reshape(1).float()
        self._loss_bad = bad if self._loss_bad is None else torch.maximum(self._loss_bad, bad)
        if self.loss_scaler is not None:
            tensor = self.loss_scaler.to(tensor.device).scale_loss(tensor)
        if self._lightning:  # lightning.Trainer: (tensor, model, optimizer, *args) -> LightningModule.backward
            super().backward(tensor, model, *args, **kwargs)
        else:  # Fabric: (tensor, module, *args)
            tensor.backward(*args, **kwargs)

    # -- optimizers -------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """lightning.Trainer's setup: prepare every optimizer (``*-master`` swaps in fp32 masters)."""
        self._lightning = True
        if self._module is None:
            self._module = getattr(model, "module", model)
        self.check_device(self._device())
        self._forget_optimizers()  # each fit/validate connects its own optimizers; earlier ones are let go
        for opt in optimizers:
            self.prepare_optimizer(opt)
        self._release_fp32_init()
        return model, optimizers, lr_schedulers

    def cuda_graphs_refusal(self) -> Optional[tuple[str, str]]:
        """(why, fix) when this plugin's setting cannot run under ``cuda_graphs=True``, else None."""
        return None

    def check_device(self, device: torch.device) -> None:
        """Before any training: bf16 on a GPU without it, ``fused=True`` without a built extension."""
        check_device_supports(self.initial_precision, device)
        if self.fused is True and device.type == "cuda":
            ops.get_extension(required=True)  # raises naming the failing source, the log and the fix

    def _release_fp32_init(self) -> None:
        """Masters were built: fp32 copies kept for params no optimizer holds would only cost memory."""

    def _forget_optimizers(self) -> None:
        self._optimizers = []

    def prepare_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """The torch optimizer inside ``optimizer``'s wrapper, prepared on first use (step phase 1)."""
        optimizer = _unwrap_optimizer(optimizer)
        if any(o is optimizer for o in self._optimizers):
            return optimizer
        if isinstance(optimizer, torch.optim.LBFGS) and self.has_master_weights:
            raise ValueError(f"{self!r} does not support torch.optim.LBFGS: it evaluates the closure again after "
                             "updating the fp32 masters, while the model computes with the half copy written back "
                             "only after the step. Use another optimizer, or a mode without master weights "
                             "('32-true', 'bf16-mixed', ...)")
        if not self._lightning and not self._optimizers:  # Fabric: the device is known at the first optimizer
            self.check_device(self._device())
        self._setup_optimizer(optimizer)
        self._optimizers.append(optimizer)
        return optimizer

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Subclasses swap in masters here."""

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Optional[Callable[[], Any]] = None,
                       **kwargs: Any) -> Any:
        """lightning.Trainer passes the closure (training_step + backward); Fabric calls after backward.
        The step phases in order (class docstring), or the ``step_runner``'s step.

        Lightning's contract holds: ``optimizer.step(closure)`` runs the closure, so the optimizer decides when (and
        how often: LBFGS) training_step and backward run, and an optimizer whose step requires a closure gets one.
        Each run of the closure is followed by ``unscale_and_check`` and ``before_step``; the update then honours
        the check on the device where the optimizer can, or else finds no gradient when the step is skipped."""
        if self.step_runner is not None:
            return self.step_runner.optimizer_step(optimizer, model, closure, **kwargs)
        optimizer = self.prepare_optimizer(optimizer)
        if closure is None:  # Fabric
            return self._step(optimizer, **kwargs)
        results: list = []

        def closure_then_check() -> Any:
            if results:  # a closure run again (LBFGS) has new grads: checked again
                G.disarm_step(optimizer)
                self._pending.pop(id(optimizer), None)
            result = closure()
            results.append(result)
            if lightning_skips_step(result, model):
                self.before_step(model, optimizer)
                G.hide_grads(optimizer)  # nothing to step
                return result
            found = self.unscale_and_check(optimizer)
            self.before_step(model, optimizer)
            G.arm_step(optimizer, found, grad_scale=self._step_scale(optimizer, found))
            return result

        try:
            output = optimizer.step(closure=closure_then_check, **self._step_kwargs(optimizer, kwargs))
        finally:
            G.disarm_step(optimizer)
        if not results or lightning_skips_step(results[-1], model):  # the closure never ran, or stepped nothing
            self.end_step(optimizer)
            return output
        found = self.unscale_and_check(optimizer)  # the last run's check
        if self.loss_scaler is not None:
            self.loss_scaler.update(found)
        self.finish_step(optimizer, found)
        return output

    def _step_scale(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Optional[torch.Tensor]:
        """The ``grad_scale`` the optimizer's step divides the grads by (None: ``unscale_and_check`` unscaled them)."""
        return None

    def _step_kwargs(self, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Arguments of ``optimizer.step`` besides the closure (decided before the closure runs)."""
        return kwargs

    def main_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The grads the optimizer reads (``*-master``: copied up into the masters first)."""
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _found_inf(self, device: torch.device) -> torch.Tensor:
        """A new flag on ``device``: set when the window's loss was non-finite."""
        if self._loss_bad is None:
            return torch.zeros(1, dtype=torch.float32, device=device)
        return self._loss_bad.to(device, copy=True)

    # -- step phases (class docstring) ----------------------------------------------------
    def unscale_and_check(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Grads up, unscaled and checked, once per step: the found_inf flag (device tensor)."""
        found = self._pending.get(id(optimizer))
        if found is not None:
            return found
        grads = self.main_grads(optimizer)
        found = self._found_inf(grads[0].device if grads else self._device())
        inv = self.loss_scaler.inv_scale().to(found.device) if self.loss_scaler is not None else None
        if grads:
            G.unscale_and_check_(grads, inv, found, self.fused)
        G.all_reduce_max_(found)
        self._pending[id(optimizer)] = found
        return found

    def step_check(self, optimizer: torch.optim.Optimizer) -> Optional[StepCheck]:
        """What ``unscale_and_check`` decided for this step of ``optimizer`` (None before it ran)."""
        found = self._pending.get(id(optimizer))
        return StepCheck(found) if found is not None else None

    def set_step_check(self, optimizer: torch.optim.Optimizer, check: StepCheck) -> None:
        """This step of ``optimizer`` was checked, with ``check``'s result (its tensors refilled by a replayed
        check): ``unscale_and_check`` returns it.  ``max_norm`` is not set: ``before_step`` decides it."""
        self._pending[id(optimizer)] = check.found_inf

    def keep_loss_flag_in(self, buffer: torch.Tensor) -> None:
        """The window's non-finite-loss flag (set by ``backward``) is copied into ``buffer`` (zero for a finite
        loss), which becomes the flag ``unscale_and_check`` reads: a captured check reads a tensor that stays put."""
        if self._loss_bad is None:
            buffer.zero_()
        elif self._loss_bad is not buffer:
            buffer.copy_(self._loss_bad.reshape(1))
        self._loss_bad = buffer

    def before_step(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        """Lightning's ``on_before_optimizer_step`` hooks (callbacks, then the module), then gradient clipping."""
        after_closure(self, model, optimizer)

    def apply_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, **kwargs: Any) -> None:
        """The optimizer step, skipped where ``found_inf`` is set, then the loss-scale update."""
        self._optimizer_step(optimizer, found_inf, **kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)

    def finish_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """After the (possibly skipped) step: skip counters and the non-finite check, ``end_step``, the automatic
        fallback's poll (reads the host only where the step already did, or every ``check_every`` steps)."""
        synced = not G.accepts_device_found_inf(optimizer)  # the step read found_inf on the host
        self.guard.update(found_inf)
        # before end_step: the message names the first parameter whose grad is still non-finite
        self.guard.check(lambda skips: self._nonfinite_message(skips, optimizer), synced=synced)
        self.end_step(optimizer)
        self._poll_auto_fallback(synced)

    def end_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The window ends: ``*-master`` copies the masters down; the modes whose fused step consumed the half grads
        release them; the window's flags reset."""
        if self.RELEASES_CONSUMED_GRADS and self.phase == "low" and G.is_mptrain_fused(optimizer) \
                and self.step_runner is None:
            # The fused step consumed the half grads: they go now.  Lightning's zero_grad comes after the next
            # training_step, so they would sit through its forward, where a compiled Llama step peaks (the fp8
            # benchmark's 8-layer model at Llama-3-8B widths: 3.7 GiB of bf16 grads in a 41.3 GiB forward peak,
            # against 37.6 GiB in backward).  Not under cuda_graphs=True, whose captured step reads the grads from
            # the same tensors every replay.
            optimizer.zero_grad(set_to_none=True)
        self._pending.pop(id(optimizer), None)
        self._loss_bad = None

    def _step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        found = self.unscale_and_check(optimizer)
        self.apply_step(optimizer, found, **kwargs)
        self.finish_step(optimizer, found)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, **kwargs: Any) -> None:
        G.step_with_found_inf(optimizer, found_inf, **kwargs)

    def unscaled_grads(self) -> dict[str, torch.Tensor]:
        """Unscaled grads by parameter name (the masters'), from ``on_before_optimizer_step`` to the step's end."""
        if self._module is None:
            return {}
        grads = {name: self._unscaled_grad(p) for name, p in self._module.named_parameters()}
        return {name: g for name, g in grads.items() if g is not None}

    def _unscaled_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        return p.grad

    # -- clipping ------------------------------------------------------------------
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """lightning.Trainer's ``gradient_clip_val``: clips the unscaled (master) grads."""
        if clip_val is None or clip_val <= 0:
            return
        optimizer = self.prepare_optimizer(optimizer)
        self.unscale_and_check(optimizer)
        by_value = gradient_clip_algorithm == GradClipAlgorithmType.VALUE
        clip = torch.nn.utils.clip_grad_value_ if by_value else torch.nn.utils.clip_grad_norm_
        clip(self.main_params(optimizer), clip_val)  # both skip params without a grad

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Fabric's clip_gradients: main grads unscaled; a step to be skipped gets finite (zeroed) grads
        so that torch's ``error_if_nonfinite`` does not pre-empt the skip."""
        optimizer = self.prepare_optimizer(optimizer)
        self.unscale_and_check(optimizer)
        for p in self.main_params(optimizer):
            if p.grad is not None:  # inf/NaN -> 0 in a step that is skipped anyway
                torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)

    # -- non-finite error -------------------------------------------------------------
    def _step_number(self) -> int:
        trainer = getattr(self._module, "_trainer", None) if self._lightning else None
        return int(trainer.global_step) if trainer is not None else self.guard.steps - 1

    def _nonfinite_message(self, skips: int, optimizer: torch.optim.Optimizer) -> str:
        s = self.loss_scaler
        scale = f"loss scale {s.scale:g} (min_scale={s.min_scale:g})" if s is not None else "no loss scaler"
        return (f"{skips} optimizer steps in a row had a non-finite loss or gradients (max_consecutive_skips="
                f"{self.guard.max_consecutive_skips}); training stopped at step {self._step_number()} with "
                f"{scale}, precision={self.precision!r}. First non-finite parameter: {self._culprit(optimizer)}. "
                f"Check the data and the learning rate, or add the offending op to fp32_fallback "
                f"(mptrain.numerics.compare_layerwise shows where precision is lost).")

    def _culprit(self, optimizer: torch.optim.Optimizer) -> str:
        if self._module is None:
            return "unknown (no module)"
        bad = (repr(name) for name, g in self.unscaled_grads().items() if not bool(torch.isfinite(g).all()))
        return next(bad, "none (the gradients are finite: the loss itself is non-finite)")

    # -- automatic fp32 fallback -------------------------------------------------------
    def enable_auto_fallback(self, module: nn.Module) -> None:
        """Watch leaf modules' outputs for inf/NaN; an offender is promoted to fp32 (see ``_poll_auto_fallback``)."""
        self._module = self._module or module
        if self.compute_dtype in HALF_DTYPES and self.phase == "low" and self.auto is None:
            self.auto = AutoFallback(module)
            self._promote_saved()

    def _poll_auto_fallback(self, synced: bool) -> None:
        if self.auto is None:
            return
        free = self._device().type == "cpu" if self.guard.free_reads is None else self.guard.free_reads
        if not (synced or free or self.guard.steps % self.guard.check_every == 0):
            return
        for name, module in self.auto.poll():  # the earliest module that overflowed since the last poll
            self.promote_module(module)
            log.warning("auto_fp32_fallback: module %r produced inf/NaN; it runs in fp32 from step %d on",
                        name, self.guard.steps)

    def _promote_saved(self) -> None:
        """Modules promoted before a resume or a new fit are promoted again."""
        modules = dict(self._module.named_modules())
        for name in self._promoted_names:
            if name in modules and name not in self.auto.promoted:
                self.auto.promoted.add(name)
                self.promote_module(modules[name])

    def promote_module(self, module: nn.Module) -> None:
        """Run ``module`` in fp32 for the rest of the run (params and compute; its output keeps its dtype)."""
        module._mpt_promoted = True
        if self.autocast_dtype is not None:
            module.forward = torch.autocast(self._device().type, enabled=False)(module.forward)
        self._hooks += run_module_in_fp32(module)

    # -- late switch to fp32 ------------------------------------------------------------
    def switch_to_fp32(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """In place: params become fp32 (the masters' exact values), optimizer state kept,
        autocast, loss scaler and fallback off; afterwards the plugin behaves as ``32-true``."""
        if self.phase == "fp32":
            return
        self._module = self._module or model
        for opt in optimizers:
            self._to_fp32(model, self.prepare_optimizer(opt))
        model.float()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.auto is not None:
            self._promoted_names = sorted(self.auto.promoted)
            self.auto.remove()
            self.auto = None
        self.precision, self.phase = "32-true", "fp32"
        self.compute_dtype = self.param_dtype = torch.float32
        self.autocast_dtype, self.fallback, self.loss_scaler = None, None, None
        log.info("precision switched from %r to '32-true'", self.initial_precision)

    def _to_fp32(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for st in optimizer.state.values():
            float_state_(st)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "initial_precision": self.initial_precision,
            "precision": self.precision,
            "phase": self.phase,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "guard": self.guard.state_dict(),
            "promoted": self.promoted,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if type(self).__qualname__ not in checkpoint:  # else load_state_dict checks
            check_mode_change(saved_mode(checkpoint), self.initial_precision)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "initial_precision" not in state_dict:  # Lightning's own plugin of the same name wrote it
            return
        check_mode_change(state_dict["initial_precision"], self.initial_precision)
        self.guard.load_state_dict(state_dict["guard"])
        if state_dict.get("phase") == "fp32" and self.phase != "fp32":
            self.switch_to_fp32(self._module, list(self._optimizers))
        if self.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self._promoted_names = list(state_dict.get("promoted", []))
        if self.auto is not None and self._module is not None:
            self._promote_saved()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint with non-finite weights is written as Lightning writes it, with a warning naming the first
        such weight (resuming it would train on from inf/NaN; the previous checkpoint may be the last good one)."""
        floats = {k: v for k, v in checkpoint.get("state_dict", {}).items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()}
        if not floats:
            return
        finite = torch.stack([torch.isfinite(v).all().to(self._device()) for v in floats.values()])
        if bool(finite.all()):  # one host read per checkpoint
            return
        name = list(floats)[int((~finite).nonzero()[0])]
        rank_zero_warn(f"saving a checkpoint whose weight {name!r} holds inf/NaN at step {self._step_number()} "
                       f"(precision={self.precision!r}): resuming it trains on from inf/NaN; an earlier checkpoint "
                       f"may be the last good one")

    def teardown(self) -> None:
        self._pending.clear()
        self._loss_bad = None


FP8_MIN_CAPABILITY = (8, 9)


def check_device_supports(name: str, device: torch.device) -> None:
    """bf16 on a GPU without bf16 (pre-Ampere) must fail before training, not produce garbage; an fp8 mode
    without fp8 tensor cores must fail rather than train in bf16 under an fp8 name."""
    device = torch.device(device)
    if name.startswith("fp8"):
        _check_fp8_device(name, device)
    if device.type != "cuda" or not name.startswith(("bf16", "fp8")):
        return
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        cap = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"precision={name!r} needs a GPU with bf16 support (compute capability >= 8.0); "
                           f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. "
                           f"Use '16-master' or '16-mixed' instead.")


def _check_fp8_device(name: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError(f"precision={name!r} needs an NVIDIA GPU with fp8 tensor cores (compute capability >= "
                           f"8.9: Ada, Hopper or newer); this run trains on {device.type!r}. Use 'bf16-master' "
                           f"there")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        raise RuntimeError(f"precision={name!r} needs fp8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
                           f"newer); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. Use "
                           f"'bf16-master' on this GPU")


def lightning_skips_step(closure_result: Any, model: Any) -> bool:
    """Lightning's rule: under automatic optimization, a ``training_step`` that returned None steps nothing."""
    return closure_result is None and getattr(model, "automatic_optimization", False)


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's or Lightning's wrapper."""
    inner = getattr(optimizer, "_optimizer", None)  # Fabric's and Lightning's wrappers both keep it here
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def float_state_(state: dict) -> None:
    """A param's optimizer state follows it to fp32 (moments, momentum buffers; not the step count)."""
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" and v.dim() > 0:
            state[k] = v.float()


__all__ = ["MptrainPrecision", "StepCheck"]
