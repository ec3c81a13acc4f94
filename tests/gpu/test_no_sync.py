"""A 16-master step with a device-side skip decision never waits for the host."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402
from mptrain import Trainer  # noqa: E402


class SyncGuard(Callback):
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


@pytest.mark.parametrize("precision", ["16-master", "bf16-master"])
@pytest.mark.parametrize("name,make", list(_optimizers()), ids=[n for n, _ in _optimizers()])
def test_60_steps_of_a_master_mode_without_host_sync(name, make, precision):
    """60 steps span two of the non-finite guard's periodic checks (every 25 steps): they read
    the skip counter from pinned memory behind an event, never waiting for the GPU."""
    class M(Classifier):
        def configure_optimizers(self):
            return make(self.parameters())

    ds = classification_data(n=64 * 32)
    x, y = (t.cuda() for t in ds.tensors)  # data already on the device
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    model = M(mlp())
    guard = SyncGuard(start=2, stop=62)
    trainer = Trainer(precision=precision, max_steps=64, accelerator="cuda", devices=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=10_000,
                      callbacks=[guard])
    try:
        trainer.fit(model, loader)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.steps_guarded == 60
    assert trainer.global_step == 64


def test_nan_every_step_ends_the_run_with_non_finite_error_without_syncing_each_step():
    from mptrain import MasterPrecision, NonFiniteError

    class Nan(Classifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    ds = classification_data(n=64 * 8)
    x, y = (t.cuda() for t in ds.tensors)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    trainer = Trainer(plugins=[MasterPrecision("bf16-master", max_consecutive_skips=8)], max_steps=400,
                      accelerator="cuda", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False)
    with pytest.raises(NonFiniteError):
        trainer.fit(Nan(mlp()), loader)
    assert trainer.global_step < 40  # stopped within a few checks of the 8th skip, not at max_steps

