"""Where ``self.log`` values go: kept as device tensors, turned into floats only when read.

``ModuleBridge`` stands in for Fabric on the LightningModule (``module._fabric``), so
``self.log`` / ``self.log_dict`` land here and ``self.trainer.X`` reads the Trainer.
Training values are the latest per name; validation values are averaged over the
epoch (weighted by batch size when given) and across ranks.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch


def _as_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if hasattr(v, "compute"):  # a torchmetrics Metric logged directly
        return torch.as_tensor(v.compute()).detach()
    return torch.as_tensor(float(v))


class MetricsStore:
    def __init__(self) -> None:
        self.stage = "train"
        self._latest: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._val_sum: dict[str, torch.Tensor] = {}
        self._val_count: dict[str, float] = {}
        self.logged: dict[str, float] = {}
        self.current_batch_size: int | None = None
        self._epoch_end: dict[str, torch.Tensor] = {}

    def take_epoch_end(self) -> dict[str, float]:
        """Values logged in on_validation_epoch_end (as floats), cleared."""
        out = {k: float(v.float().item()) for k, v in self._epoch_end.items()}
        self._epoch_end = {}
        return out

    @property
    def callback_metrics(self) -> dict[str, float]:
        return {k: float(v.float().item()) if isinstance(v, torch.Tensor) else float(v) for k, v in self._latest.items()}

    def record(self, metrics: Mapping[str, Any], batch_size: int | None = None) -> None:
        for name, value in metrics.items():
            t = _as_tensor(value)
            if self.stage == "val_end":
                self._epoch_end[name] = t
                self._latest[name] = t
            elif self.stage == "val":
                w = float(batch_size or self.current_batch_size or 1)
                s = t.float() * w
                self._val_sum[name] = s if name not in self._val_sum else self._val_sum[name] + s
                self._val_count[name] = self._val_count.get(name, 0.0) + w
            else:
                self._latest[name] = t
                self._pending[name] = t

    def record_step(self, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            self._latest[k] = _as_tensor(v)

    def pending_train(self) -> dict[str, torch.Tensor]:
        out, self._pending = self._pending, {}
        return out

    def update_logged(self, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            self.logged[k] = v
            self._latest[k] = _as_tensor(v)

    def start_validation(self) -> None:
        self.stage = "val"
        self._val_sum, self._val_count = {}, {}

    def end_validation(self, fabric) -> dict[str, float]:
        self.stage = "train"
        out = {}
        for name in sorted(self._val_sum):
            total = self._val_sum[name].float().reshape(1)
            count = torch.tensor([self._val_count[name]], dtype=torch.float32, device=total.device)
            if fabric.world_size > 1:
                both = fabric.all_reduce(torch.cat([total, count]), reduce_op="sum")
                total, count = both[:1], both[1:]
            out[name] = float((total / count).item())
        self._latest.update({k: torch.tensor(v) for k, v in out.items()})
        return out


class ModuleBridge:
    """Installed as ``module._fabric``: logging goes to the Trainer; other attributes to the Trainer, then Fabric."""

    def __init__(self, trainer) -> None:
        object.__setattr__(self, "_trainer", trainer)

    @classmethod
    def attach(cls, module: torch.nn.Module, trainer) -> None:
        bridge = cls(trainer)
        for m in module.modules():
            if hasattr(m, "_fabric"):
                m._fabric = bridge

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self._trainer.metrics.record(metrics)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self._trainer.metrics.record({name: value})

    def __getattr__(self, item: str) -> Any:
        trainer = object.__getattribute__(self, "_trainer")
        try:
            return getattr(trainer, item)
        except AttributeError:
            return getattr(trainer.fabric, item)
