"""Plain ``lightning.Trainer`` / data helpers for the precision plugin tests (no mptrain.Trainer)."""
from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch import Callback

from _models import classification_data


def loader(n: int = 128, bs: int = 32, shuffle: bool = False):
    return torch.utils.data.DataLoader(classification_data(n=n), batch_size=bs, shuffle=shuffle)


def trainer(plugin, **kw) -> L.Trainer:
    for k, v in dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False).items():
        kw.setdefault(k, v)
    return L.Trainer(plugins=[plugin], **kw)


def weights(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class StepRecorder(Callback):
    """The module's params before and after every optimizer step (by global_step), and the scaler trace."""

    def __init__(self):
        self.before: dict[int, list] = {}
        self.after: dict[int, list] = {}
        self.trace: list = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before[trainer.global_step] = weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if step in self.before and step not in self.after:
            self.after[step] = weights(pl_module)
            plugin = trainer.precision_plugin
            s = plugin.loss_scaler
            self.trace.append((s.scale if s else None, s.hysteresis_left if s else None, plugin.skipped_steps))

    def unchanged(self, step: int) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.before[step], self.after[step]))
