"""A 16-master step with a device-side skip decision never waits for the host."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402
from mptrain import Trainer  # noqa: E402


class SyncGuard:
    """Turns on CUDA's sync debug mode ("error") for steps [start, stop)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.steps_guarded = start, stop, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.start:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.start < trainer.global_step <= self.stop:
            self.steps_guarded += 1
        if trainer.global_step == self.stop:
            torch.cuda.set_sync_debug_mode("default")


def _optimizers():
    yield "torch-fused-adamw", lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)
    try:
        from mptrain.optim import FusedAdamW
    except ImportError:
        return
    yield "mptrain-fused-adamw", lambda params: FusedAdamW(params, lr=1e-3)


@pytest.mark.parametrize("name,make", list(_optimizers()), ids=[n for n, _ in _optimizers()])
def test_20_steps_16_master_without_host_sync(name, make):
    class M(Classifier):
        def configure_optimizers(self):
            return make(self.parameters())

    ds = classification_data(n=64 * 32)
    x, y = (t.cuda() for t in ds.tensors)  # data already on the device
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    model = M(mlp())
    guard = SyncGuard(start=2, stop=22)
    trainer = Trainer(precision="16-master", max_steps=24, accelerator="cuda", devices=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=10_000,
                      callbacks=[guard])
    try:
        trainer.fit(model, loader)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.steps_guarded == 20
    assert trainer.global_step == 24

