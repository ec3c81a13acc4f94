"""OverflowMonitor: per-module inf/NaN, near-max and fp16-underflow counts during training.

A Trainer callback.  Forward hooks on the leaf modules count, in each module's output,
the non-finite values and the values near the largest finite number of the output's
dtype; ``on_before_optimizer_step`` counts the same in each module's own parameter
gradients, plus the non-zero gradients that fp16 would flush to zero at the current loss
scale (``|g * scale| < 2**-24``).  The counts accumulate on the device; they cross to
the host only on logging steps (every ``log_every_n_steps`` optimizer steps), where they
are logged as fractions through ``trainer.log_metrics`` under
``numerics/<module>/{out_nonfinite,out_near_max,grad_nonfinite,grad_near_max,grad_underflow}``.

When the Trainer skipped a step (``trainer.skipped_steps`` grew), the modules whose
gradients were non-finite since the last check are logged and kept in
``last_nonfinite_modules``.  On the GPU that check runs on logging steps only (reading
``skipped_steps`` is a host sync); on the CPU, where a sync costs nothing, every step.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from mptrain.callbacks import Callback

log = logging.getLogger("mptrain.numerics")

#: the smallest positive fp16 subnormal: anything smaller in magnitude becomes 0 in fp16
FP16_TINY = 2.0**-24
_HALF = (torch.float16, torch.bfloat16)
# Columns of the accumulators.
_NONFINITE, _NEARMAX, _UNDERFLOW, _COUNT = range(4)


def _near_max_threshold(dtype: torch.dtype, ratio: float) -> float:
    """``ratio`` x the largest finite value of a half dtype; fp16's for anything wider,
    because fp16 is where a value that large would overflow."""
    return ratio * torch.finfo(dtype if dtype in _HALF else torch.float16).max


class OverflowMonitor(Callback):
    """Counts overflow / underflow per module and names the culprits of skipped steps.

    Args:
        log_every_n_steps: log the accumulated fractions every N optimizer steps.
        near_max_ratio: a value counts as near-max when ``|x| >= near_max_ratio * max``
            of its dtype (fp16's max for fp32 tensors).
        watch_outputs: count module outputs (forward hooks on leaf modules) as well as grads.
        sync_every_step: check for skipped steps after every optimizer step even on the GPU
            (one host sync per step).

    Attributes:
        last_nonfinite_modules: modules whose gradients were non-finite at the last skipped step.
        history: list of ``(global_step, [module names])`` for every skip noticed.
    """

    def __init__(self, log_every_n_steps: int = 50, near_max_ratio: float = 0.5, watch_outputs: bool = True,
                 sync_every_step: bool = False):
        if int(log_every_n_steps) < 1:
            raise ValueError(f"OverflowMonitor: log_every_n_steps={log_every_n_steps} must be >= 1")
        if not 0 < near_max_ratio <= 1:
            raise ValueError(f"OverflowMonitor: near_max_ratio={near_max_ratio} must be in (0, 1]")
        self.log_every_n_steps = int(log_every_n_steps)
        self.near_max_ratio = float(near_max_ratio)
        self.watch_outputs = watch_outputs
        self.sync_every_step = sync_every_step
        self.last_nonfinite_modules: list[str] = []
        self.history: list[tuple[int, list[str]]] = []
        self._handles: list = []
        self._out_names: list[str] = []
        self._grad_names: list[str] = []
        self._grad_params: list[list[nn.Parameter]] = []
        self._out_acc: Optional[torch.Tensor] = None   # [modules, 4] float64 on the device
        self._grad_acc: Optional[torch.Tensor] = None  # [modules, 4]
        self._pending_bad: Optional[torch.Tensor] = None  # [modules] bool: non-finite grad since last check
        self._skipped_seen = 0
        self._last_step_seen = 0
        self._last_logged_step = -1

    # -- setup ------------------------------------------------------------
    def setup_module(self, module: nn.Module, device: Optional[torch.device] = None) -> None:
        """Attach to ``module`` (called by ``on_fit_start``; public for use outside the Trainer)."""
        self.teardown()
        device = device or next((p.device for p in module.parameters()), torch.device("cpu"))
        self._grad_names, self._grad_params = [], []
        for name, m in module.named_modules():
            params = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if params:
                self._grad_names.append(name)
                self._grad_params.append(params)
        self._grad_acc = torch.zeros(len(self._grad_names), 4, dtype=torch.float64, device=device)
        self._pending_bad = torch.zeros(len(self._grad_names), dtype=torch.bool, device=device)
        self._out_names = []
        if self.watch_outputs:
            leaves = [(n, m) for n, m in module.named_modules() if next(iter(m.children()), None) is None]
            for i, (name, m) in enumerate(leaves):
                self._out_names.append(name)
                self._handles.append(m.register_forward_hook(self._output_hook(i)))
        self._out_acc = torch.zeros(len(self._out_names), 4, dtype=torch.float64, device=device)

    def teardown(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _output_hook(self, i: int):
        def hook(module, args, output):
            # Training forwards only: validation has its own numerics and no gradients.
            if not module.training or not torch.is_grad_enabled():
                return None
            for t in _float_tensors(output):
                self._out_acc[i] += self._counts(t, None).to(self._out_acc.device)
            return None
        return hook

    def _counts(self, t: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        """[non-finite, near-max, fp16 underflow at ``scale``, numel] of ``t`` (device tensor)."""
        t = t.detach()
        a = t.abs()
        nonfinite = (~torch.isfinite(t)).sum()
        near = (torch.isfinite(t) & (a >= _near_max_threshold(t.dtype, self.near_max_ratio))).sum()
        if scale is not None:
            under = ((t != 0) & (a.float() * scale < FP16_TINY)).sum()
        else:
            under = torch.zeros((), dtype=torch.int64, device=t.device)
        # new_full is a fill kernel; torch.tensor(n, device=cuda) would be a host-to-device copy.
        return torch.stack([nonfinite, near, under, nonfinite.new_full((), t.numel())]).double()

    # -- Trainer hooks ----------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self.setup_module(pl_module)
        self._skipped_seen = int(getattr(trainer, "skipped_steps", 0))
        self._last_step_seen = int(getattr(trainer, "global_step", 0))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._check_skipped(trainer)
        self.teardown()

    def on_exception(self, trainer, pl_module, exception) -> None:
        # A NonFiniteError is exactly when the names matter most.
        try:
            self._check_skipped(trainer)
        finally:
            self.teardown()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._grad_acc is None:
            self.setup_module(pl_module)
        scale = _scale_tensor(trainer, self._grad_acc.device)
        rows = []
        for params in self._grad_params:
            c = torch.zeros(4, dtype=torch.float64, device=self._grad_acc.device)
            for p in params:
                if p.grad is not None:
                    c = c + self._counts(p.grad, scale).to(c.device)
            rows.append(c)
        if rows:
            step = torch.stack(rows)
            self._grad_acc += step
            self._pending_bad |= step[:, _NONFINITE] > 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if step == self._last_step_seen:
            return  # inside an accumulation window: no optimizer step yet
        self._last_step_seen = step
        logging_step = step % self.log_every_n_steps == 0
        on_cpu = self._grad_acc is not None and self._grad_acc.device.type == "cpu"
        if logging_step or on_cpu or self.sync_every_step:
            self._check_skipped(trainer)
        if logging_step and step != self._last_logged_step:
            self._last_logged_step = step
            self.flush(trainer)

    # -- reporting --------------------------------------------------------
    def _check_skipped(self, trainer) -> None:
        """Name the modules with non-finite grads if a step was skipped since the last check."""
        if self._pending_bad is None:
            return
        skipped = int(getattr(trainer, "skipped_steps", 0))
        if skipped > self._skipped_seen:
            bad = self._pending_bad.nonzero().flatten().tolist()
            names = [self._grad_names[i] or "<root>" for i in bad]
            self.last_nonfinite_modules = names
            step = int(getattr(trainer, "global_step", 0))
            self.history.append((step, names))
            scale = getattr(getattr(trainer, "loss_scaler", None), "scale", None)
            log.warning("step %d skipped (%d skipped so far, loss scale now %s): non-finite gradients in %s",
                        step, skipped, scale, ", ".join(names) if names else "no module (the loss itself?)")
        self._skipped_seen = skipped
        self._pending_bad.zero_()

    def metrics(self) -> dict[str, float]:
        """The accumulated fractions since the last flush, by metric name (one host sync)."""
        out: dict[str, float] = {}
        if self._grad_acc is None:
            return out
        acc = [self._out_acc.cpu().tolist(), self._grad_acc.cpu().tolist()]
        total_under, total_grad = 0.0, 0.0
        for name, (nf, near, _, n) in zip(self._out_names, acc[0]):
            if n:
                key = name or "<root>"
                out[f"numerics/{key}/out_nonfinite"] = nf / n
                out[f"numerics/{key}/out_near_max"] = near / n
        for name, (nf, near, under, n) in zip(self._grad_names, acc[1]):
            if n:
                key = name or "<root>"
                out[f"numerics/{key}/grad_nonfinite"] = nf / n
                out[f"numerics/{key}/grad_near_max"] = near / n
                out[f"numerics/{key}/grad_underflow"] = under / n
                total_under += under
                total_grad += n
        if total_grad:
            out["numerics/grad_underflow"] = total_under / total_grad
            out["numerics/modules_with_nonfinite_grad"] = float(sum(1 for r in acc[1] if r[_NONFINITE] > 0))
        out["numerics/modules_with_nonfinite_output"] = float(sum(1 for r in acc[0] if r[_NONFINITE] > 0))
        return out

    def flush(self, trainer=None) -> dict[str, float]:
        """Log the accumulated fractions (when given a trainer) and reset the counters."""
        metrics = self.metrics()
        if trainer is not None and metrics:
            trainer.log_metrics(metrics, step=int(getattr(trainer, "global_step", 0)))
        if self._grad_acc is not None:
            self._grad_acc.zero_()
            self._out_acc.zero_()
        return metrics

    def state_dict(self) -> dict:
        return {"history": [[s, list(n)] for s, n in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(int(s), list(n)) for s, n in state.get("history", [])]


def _scale_tensor(trainer, device: torch.device) -> torch.Tensor:
    """The current loss scale as a device tensor (1 without a scaler), without a host sync."""
    scaler = getattr(trainer, "loss_scaler", None)
    if scaler is None:
        return torch.ones((), device=device)
    t = getattr(scaler, "scale_tensor", None)
    if isinstance(t, torch.Tensor):
        return t.to(device)
    return torch.tensor(float(scaler.scale), device=device)


def _float_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _float_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _float_tensors(v)]
    return []
