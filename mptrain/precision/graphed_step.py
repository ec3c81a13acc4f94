"""The optimizer side of ``cuda_graphs=True`` (the order is in :mod:`mptrain.callbacks.cuda_graphs`): the
plugin's ``_prepare``, and its optimizer step with the loss-scaler update, replayed from two CUDA graphs.

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

log = logging.getLogger("mptrain")

_FIX = "The optimizer must honour found_inf on the device (mptrain.optim's fused optimizers, or torch's with " \
       "fused=True, capturable=True)."


class GraphedStep:
    """Replays ``plugin``'s optimizer step from CUDA graphs after ``warmup_steps`` eager steps.

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
        self.prepare: Optional[torch.cuda.CUDAGraph] = None
        self.update: Optional[torch.cuda.CUDAGraph] = None

    @property
    def captured(self) -> bool:
        return self.update is not None

    def install(self) -> None:
        self.plugin.optimizer_step = self.optimizer_step  # Lightning's strategy calls plugin.optimizer_step

    def uninstall(self) -> None:
        self.plugin.__dict__.pop("optimizer_step", None)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Optional[Callable[[], Any]] = None,
                       **kwargs: Any) -> Any:
        if closure is None or kwargs:
            raise CudaGraphError(
                "cuda_graphs=True graphs lightning.Trainer's automatic optimization: optimizer.step() is called "
                f"with {'no closure (Fabric?)' if closure is None else f'arguments {sorted(kwargs)}'}. Call "
                "optimizer.step() without arguments from LightningModule.optimizer_step, or use cuda_graphs=False")
        plugin = self.plugin
        optimizer = plugin._ensure_ready(optimizer)  # unwrapped, as in the plugin's own optimizer_step
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            raise CudaGraphError("cuda_graphs=True graphs the step of one optimizer; the run stepped "
                                 f"{type(self.optimizer).__name__} and now {type(optimizer).__name__}")
        capture_now = not self.captured and self.steps >= self.warmup_steps and self.stepped > 0
        with self.around_closure(capture_now or self.captured):
            result = closure()
        self.steps += 1
        if result is None and getattr(model, "automatic_optimization", False):  # training_step returned None
            plugin._after_closure(model, optimizer)
            plugin._end_step(optimizer)
        elif self.captured:
            self._replay(optimizer, model)
        elif capture_now:
            self._capture(optimizer, model)
        else:
            plugin._prepare(optimizer)
            plugin._after_closure(model, optimizer)
            plugin._step(optimizer)
            self.stepped += 1
        return result

    def _capture(self, optimizer: torch.optim.Optimizer, model: Any) -> None:
        plugin, key = self.plugin, id(optimizer)
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.loss_bad = torch.zeros(1, dtype=torch.float32, device=device)
        self._load_loss_bad()
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        self._load_lrs(optimizer)
        pool = torch.cuda.graph_pool_handle()
        self.prepare = torch.cuda.CUDAGraph()
        plugin._pending.pop(key, None)
        had_grad = {id(p) for p in _params(optimizer) if p.grad is not None}  # made by the backward
        with capture(self.prepare, pool, "the unscale and inf/NaN check of the optimizer step", _FIX):
            self.found = plugin._prepare(optimizer)
        self.norm = getattr(plugin, "_fused_norm", {}).get(key)  # the fused *-master path's grad norm
        # param id -> (its grad the graphs read, made by `prepare` (the masters' on the generic path))
        self.grads = {id(p): (p.grad, id(p) not in had_grad) for p in _params(optimizer) if p.grad is not None}
        self.prepare.replay()
        plugin._after_closure(model, optimizer)
        self.clip = getattr(plugin, "_fused_clip", {}).get(key)  # the captured step pops it
        update = torch.cuda.CUDAGraph()
        with _lr_tensors(optimizer, self.lrs), \
                capture(update, pool, "the optimizer step and the loss-scale update", _FIX):
            plugin._optimizer_step(optimizer, self.found)
            if plugin.loss_scaler is not None:
                plugin.loss_scaler.update(self.found)
        self.update = update
        self.hyper = _hyperparameters(optimizer)
        self.update.replay()
        self.replays += 1
        self._finish(optimizer)
        log.info("cuda_graphs=True: the train step was captured at optimizer step %d; later steps replay it",
                 self.steps - 1)

    def _replay(self, optimizer: torch.optim.Optimizer, model: Any) -> None:
        plugin, key = self.plugin, id(optimizer)
        self._load_loss_bad()
        self._point_grads(optimizer)
        self.prepare.replay()
        plugin._pending[key] = self.found
        if self.norm is not None:
            plugin._fused_norm[key] = self.norm
        plugin._after_closure(model, optimizer)
        clip = getattr(plugin, "_fused_clip", {}).pop(key, None)
        if clip != self.clip:
            raise CudaGraphError(f"cuda_graphs=True: gradient clipping changed from {self.clip!r} to {clip!r} after "
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
        """The plugin's ``_step`` after its device part: guard counters and check, end of step."""
        plugin = self.plugin
        plugin.guard.update(self.found)
        plugin.guard.check(lambda skips: plugin._nonfinite_message(skips, optimizer), synced=False)
        plugin._end_step(optimizer)
        plugin._poll_auto_fallback(False)

    def _load_loss_bad(self) -> None:
        """The window's non-finite-loss flag (set by the plugin's eager backward) into the captured buffer."""
        bad = self.plugin._loss_bad
        if bad is None:
            self.loss_bad.zero_()
        elif bad is not self.loss_bad:
            self.loss_bad.copy_(bad.reshape(1))
        self.plugin._loss_bad = self.loss_bad

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
