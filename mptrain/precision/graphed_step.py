"""The optimizer side of ``cuda_graphs=True`` (the order is in :mod:`mptrain.callbacks.cuda_graphs`): the
precision plugin's step phases (:class:`~mptrain.precision.plugin.MptrainPrecision`), with ``unscale_and_check``
and ``apply_step`` (the optimizer step with the loss-scaler update) replayed from two CUDA graphs.

Inputs that change between steps live in buffers that stay put: the loss's non-finite flag, each
group's ``lr`` (a device scalar, so LR schedulers keep working), the grads (``.grad`` is pointed back
at them after ``zero_grad(set_to_none=True)``) and the scaler's state.  Any other hyperparameter, the
clipping setting and the optimizer are fixed at capture: a change raises :class:`CudaGraphError`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional

import torch

from mptrain.precision.graph_capture import CudaGraphError, capture
from mptrain.precision.plugin import StepCheck, lightning_skips_step

log = logging.getLogger("mptrain")

_FIX = "The optimizer must honour found_inf on the device (mptrain.optim's fused optimizers, or torch's with " \
       "fused=True, capturable=True)."


class GraphedStep:
    """Replays ``plugin``'s optimizer step from CUDA graphs after ``warmup_steps`` eager steps: installed as the
    plugin's ``step_runner``, it drives the plugin's step phases in the plugin's order.

    ``around_closure(capture)`` returns the context the closure runs in (the graphed forward's).
    """

    def __init__(self, plugin: Any, warmup_steps: int = 3):
        self.plugin = plugin
        self.warmup_steps = warmup_steps
        self.around_closure: Callable[[bool], Any] = lambda capture: contextlib.nullcontext()
        self.steps = 0  # optimizer_step calls so far
        self.stepped = 0  # eager optimizer steps taken: the optimizer state exists before its step is captured
        self.replays = 0  # steps run from the graphs (the capturing step included)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.prepare: Optional[torch.cuda.CUDAGraph] = None  # the plugin's unscale_and_check
        self.update: Optional[torch.cuda.CUDAGraph] = None  # the plugin's apply_step
        self.check: Optional[StepCheck] = None  # what the captured unscale_and_check decides, refilled by `prepare`

    @property
    def captured(self) -> bool:
        return self.update is not None

    def install(self) -> None:
        self.plugin.step_runner = self  # the plugin's optimizer_step (what Lightning's strategy calls) hands over

    def uninstall(self) -> None:
        if self.plugin.step_runner is self:
            self.plugin.step_runner = None

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Optional[Callable[[], Any]] = None,
                       **kwargs: Any) -> Any:
        if closure is None or kwargs:
            raise CudaGraphError(
                "cuda_graphs=True graphs lightning.Trainer's automatic optimization: optimizer.step() is called "
                f"with {'no closure (Fabric?)' if closure is None else f'arguments {sorted(kwargs)}'}. Call "
                "optimizer.step() without arguments from LightningModule.optimizer_step, or use cuda_graphs=False")
        plugin = self.plugin
        optimizer = plugin.prepare_optimizer(optimizer)
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            raise CudaGraphError("cuda_graphs=True graphs the step of one optimizer; the run stepped "
                                 f"{type(self.optimizer).__name__} and now {type(optimizer).__name__}")
        capture_now = not self.captured and self.steps >= self.warmup_steps and self.stepped > 0
        with self.around_closure(capture_now or self.captured):
            result = closure()
        self.steps += 1
        if lightning_skips_step(result, model):
            plugin.before_step(model, optimizer)
            plugin.end_step(optimizer)
        elif self.captured:
            self._replay(optimizer, model)
        elif capture_now:
            self._capture(optimizer, model)
        else:
            found = plugin.unscale_and_check(optimizer)
            plugin.before_step(model, optimizer)
            plugin.apply_step(optimizer, found)
            plugin.finish_step(optimizer, found)
            self.stepped += 1
        return result

    def _capture(self, optimizer: torch.optim.Optimizer, model: Any) -> None:
        plugin = self.plugin
        if plugin.step_check(optimizer) is not None:
            raise CudaGraphError("cuda_graphs=True: the gradients were unscaled and checked before the optimizer step "
                                 "(clip_gradients called from training_step or on_after_backward?); that check is "
                                 "part of the captured step. Leave clipping to gradient_clip_val, or use "
                                 "cuda_graphs=False")
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.loss_bad = torch.zeros(1, dtype=torch.float32, device=device)
        plugin.keep_loss_flag_in(self.loss_bad)
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        self._load_lrs(optimizer)
        pool = torch.cuda.graph_pool_handle()
        self.prepare = torch.cuda.CUDAGraph()
        had_grad = {id(p) for p in _params(optimizer) if p.grad is not None}  # made by the backward
        with capture(self.prepare, pool, "the unscale and inf/NaN check of the optimizer step", _FIX):
            found = plugin.unscale_and_check(optimizer)
        # param id -> (its grad the graphs read, made by `prepare` (the masters' on the generic path))
        self.grads = {id(p): (p.grad, id(p) not in had_grad) for p in _params(optimizer) if p.grad is not None}
        self.prepare.replay()
        plugin.before_step(model, optimizer)
        self.check = plugin.step_check(optimizer)  # after clipping: its max_norm is captured with the step
        update = torch.cuda.CUDAGraph()
        with _lr_tensors(optimizer, self.lrs), \
                capture(update, pool, "the optimizer step and the loss-scale update", _FIX):
            plugin.apply_step(optimizer, found)
        self.update = update
        self.hyper = _hyperparameters(optimizer)
        self.update.replay()
        self.replays += 1
        self._finish(optimizer)
        log.info("cuda_graphs=True: the train step was captured at optimizer step %d; later steps replay it",
                 self.steps - 1)

    def _replay(self, optimizer: torch.optim.Optimizer, model: Any) -> None:
        plugin = self.plugin
        plugin.keep_loss_flag_in(self.loss_bad)
        self._point_grads(optimizer)
        self.prepare.replay()
        plugin.set_step_check(optimizer, self.check)
        plugin.before_step(model, optimizer)
        clip, captured = plugin.step_check(optimizer).max_norm, self.check.max_norm
        if clip != captured:
            raise CudaGraphError(f"cuda_graphs=True: gradient clipping changed from {captured!r} to {clip!r} after "
                                 "the optimizer step was captured (it is part of the graph); clip with one "
                                 "gradient_clip_val for the whole run, or use cuda_graphs=False")
        _check_hyperparameters(self.hyper, optimizer)
        self._load_lrs(optimizer)
        self.update.replay()
        self.replays += 1
        self._finish(optimizer)

    def _point_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Every grad the optimizer reads is the tensor the graphs were captured with, holding this step's values."""
        for p in _params(optimizer):
            g, made_by_prepare = self.grads.get(id(p), (None, False))
            if p.grad is g:
                continue
            if g is None or (p.grad is None and not made_by_prepare):
                has = "has no gradient" if p.grad is None else "has a gradient"
                raise CudaGraphError(
                    f"cuda_graphs=True: a parameter of shape {tuple(p.shape)} {has} at step {self.steps}, unlike "
                    "when the optimizer step was captured: the captured step updates a fixed set of parameters. "
                    "Use the same parameters every step, or train with cuda_graphs=False")
            if p.grad is not None:  # made eagerly (a parameter used outside forward): into the captured tensor
                g.copy_(p.grad)
            p.grad = g  # after zero_grad(set_to_none=True): `prepare` fills it again

    def _finish(self, optimizer: torch.optim.Optimizer) -> None:
        self.plugin.finish_step(optimizer, self.check.found_inf)

    def _load_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        for lr, group in zip(self.lrs, optimizer.param_groups):
            lr.fill_(group["lr"])  # a launch with the value as argument: no host sync


@contextlib.contextmanager
def _lr_tensors(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor]):
    """While capturing, each group's lr is the device scalar the replays refill (a float would be baked in)."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: (list(v) if k == "params" else v) for k, v in g.items() if k != "lr"} for g in optimizer.param_groups]


def _check_hyperparameters(captured: list[dict], optimizer: torch.optim.Optimizer) -> None:
    now = _hyperparameters(optimizer)
    if len(now) != len(captured):
        raise CudaGraphError(f"cuda_graphs=True: the optimizer had {len(captured)} param groups when its step was "
                             f"captured and has {len(now)} now; add param groups before training, or use "
                             "cuda_graphs=False")
    for i, (old, new) in enumerate(zip(captured, now)):
        for k in old.keys() | new.keys():
            a, b = old.get(k), new.get(k)
            same = a is b or (k == "params" and [id(p) for p in a] == [id(p) for p in b]) or \
                (not isinstance(a, (torch.Tensor, list)) and type(a) is type(b) and a == b)
            if not same:
                raise CudaGraphError(
                    f"cuda_graphs=True: param group {i}'s {k!r} changed from {_short(a)} to {_short(b)} after the "
                    "optimizer step was captured; the captured step follows only 'lr'. Keep the other "
                    "hyperparameters fixed (e.g. OneCycleLR(cycle_momentum=False)), or use cuda_graphs=False")


def _short(value: Any) -> str:
    return f"{type(value).__name__} of {len(value)}" if isinstance(value, list) else repr(value)[:60]
