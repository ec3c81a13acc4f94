"""OverflowMonitor: per-layer overflow / underflow statistics to any Lightning logger.

Counted on the device: inf/NaN and near-max values in each leaf module's training outputs (forward hooks) and, per
module, in its unscaled gradients, plus the non-zero gradients fp16 would flush to zero at the current loss scale
(``|g * scale| < 2**-24``).  Every ``every_n_steps`` optimizer steps they cross to the host and are logged as
fractions under ``overflow/<module>/{out_nonfinite,out_near_max,grad_nonfinite,grad_near_max,grad_underflow}``.
"""
from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch import Callback
from torch import nn

from mptrain.callbacks._plugin import require_mptrain_plugin
from mptrain.precision import HALF_DTYPES

FP16_TINY = 2.0**-24  # the smallest positive fp16 subnormal
_OUT_KEYS = ("out_nonfinite", "out_near_max")
_GRAD_KEYS = ("grad_nonfinite", "grad_near_max", "grad_underflow")


def _near_max(dtype: torch.dtype, ratio: float) -> float:
    """``ratio`` x the largest finite value of a half dtype; fp16's for fp32 (where it would overflow)."""
    return ratio * torch.finfo(dtype if dtype in HALF_DTYPES else torch.float16).max


class OverflowMonitor(Callback):
    """Per-layer overflow/underflow fractions, logged every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: log (and read the device counters) every N optimizer steps.
        near_max_ratio: a value is near-max when ``|x| >= near_max_ratio * max`` of its dtype.
        watch_outputs: also count module outputs (forward hooks on the leaf modules).
    """

    def __init__(self, every_n_steps: int = 50, near_max_ratio: float = 0.5, watch_outputs: bool = True):
        if int(every_n_steps) < 1:
            raise ValueError(f"OverflowMonitor: every_n_steps={every_n_steps!r} must be >= 1")
        if not 0 < near_max_ratio <= 1:
            raise ValueError(f"OverflowMonitor: near_max_ratio={near_max_ratio!r} must be in (0, 1]")
        self.every_n_steps, self.near_max_ratio, self.watch_outputs = int(every_n_steps), near_max_ratio, watch_outputs
        self._plugin = None
        self._handles: list = []
        self._out_names: list[str] = []
        self._grad_names: dict[str, int] = {}  # module owning parameters -> its row
        self._out_acc: Optional[torch.Tensor] = None  # [modules, 3]: nonfinite, near-max, numel
        self._grad_acc: Optional[torch.Tensor] = None  # [modules, 4]: nonfinite, near-max, underflow, numel
        self._last_step = -1

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._plugin = require_mptrain_plugin(trainer, self)

    def on_fit_start(self, trainer, pl_module) -> None:
        device = next((p.device for p in pl_module.parameters()), torch.device("cpu"))
        owners = [n for n, m in pl_module.named_modules() if any(True for _ in m.parameters(recurse=False))]
        self._grad_names = {n: i for i, n in enumerate(owners)}
        self._grad_acc = torch.zeros(len(self._grad_names), 4, dtype=torch.float64, device=device)
        leaves = [(n, m) for n, m in pl_module.named_modules() if n and next(iter(m.children()), None) is None]
        self._out_names = [n for n, _ in leaves] if self.watch_outputs else []
        self._out_acc = torch.zeros(len(self._out_names), 3, dtype=torch.float64, device=device)
        if self.watch_outputs:
            self._handles = [m.register_forward_hook(self._output_hook(i)) for i, (_, m) in enumerate(leaves)]

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _output_hook(self, i: int):
        def hook(module: nn.Module, args, output) -> None:
            if not module.training or not torch.is_grad_enabled():
                return  # training forwards only
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t = t.detach()
                    bad = (~torch.isfinite(t)).sum()
                    near = (torch.isfinite(t) & (t.abs() >= _near_max(t.dtype, self.near_max_ratio))).sum()
                    row = torch.stack([bad, near, bad.new_full((), t.numel())]).double()
                    self._out_acc[i] += row.to(self._out_acc.device)
        return hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        scaler = self._plugin.loss_scaler
        scale = scaler.scale_tensor if scaler is not None else None
        for name, g in self._plugin.unscaled_grads().items():  # by pl_module's parameter names
            row = self._grad_names.get(name.rpartition(".")[0])  # the module that owns the parameter
            if row is not None:
                self._grad_acc[row] += self._grad_counts(g, scale).to(self._grad_acc.device)

    def _grad_counts(self, g: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = self._plugin.compute_dtype  # where the grads are (or were) computed
        g = g.detach().float()
        scaled = (g * scale.to(g.device)).abs() if scale is not None else g.abs()
        bad = (~torch.isfinite(g)).sum()
        near = (torch.isfinite(scaled) & (scaled >= _near_max(dtype, self.near_max_ratio))).sum()
        under = ((g != 0) & (scaled < FP16_TINY)).sum() if dtype == torch.float16 else torch.zeros_like(bad)
        return torch.stack([bad, near, under, bad.new_full((), g.numel())]).double()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps != 0:
            return
        self._last_step = step
        metrics = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def metrics(self) -> dict[str, float]:
        """The fractions accumulated since the last call, by metric name (one host read); resets them."""
        out: dict[str, float] = {}
        for names, acc, keys in ((self._out_names, self._out_acc, _OUT_KEYS),
                                 (self._grad_names, self._grad_acc, _GRAD_KEYS)):
            if acc is None:
                continue
            for name, row in zip(names, acc.cpu().tolist()):  # a row: the counts, then numel
                out.update({f"overflow/{name or '<root>'}/{key}": n / max(row[-1], 1.0) for key, n in zip(keys, row)})
            acc.zero_()
        return out
