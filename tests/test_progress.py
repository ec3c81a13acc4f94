"""ProgressBar: plain periodic lines off a terminal, a rich bar on one, silence off rank 0."""
from __future__ import annotations

import io

import torch

from mptrain.progress import ProgressBar, _fmt_time


class FakeScaler:
    scale = 1024.0


class FakeTrainer:
    def __init__(self, rank0=True, total=20, log_every=5):
        self.is_global_zero = rank0
        self.global_step = 0
        self.current_epoch = 0
        self.estimated_stepping_batches = total
        self.log_every_n_steps = log_every
        self.loss_scaler = FakeScaler()
        self.world_size = 1
        self.callback_metrics = {}
        self.logged = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, metrics))


class TTY(io.StringIO):
    def isatty(self):
        return True


def drive(bar, trainer, steps=20, batch=None):
    batch = batch if batch is not None else (torch.zeros(8, 3), torch.zeros(8))
    bar.on_fit_start(trainer, None)
    for i in range(steps):
        trainer.global_step += 1
        trainer.callback_metrics = {"samples_per_sec": 100.0, "val/acc": 0.5}
        bar.on_train_batch_end(trainer, None, {"loss": torch.tensor(0.25)}, batch, i)
    bar.on_validation_epoch_end(trainer, None)
    bar.on_fit_end(trainer, None)


def test_plain_lines_every_n_steps_with_loss_scale_rate_eta():
    out = io.StringIO()
    drive(ProgressBar(stream=out), FakeTrainer())
    lines = out.getvalue().splitlines()
    steps = [ln for ln in lines if ln.startswith("epoch 0 step")]
    assert [ln.split()[3] for ln in steps] == ["5/20", "10/20", "15/20", "20/20"]
    for ln in steps:
        assert "loss 0.2500" in ln and "scale 1024" in ln and "samples/s" in ln and "eta" in ln
    assert any("validation" in ln and "val/acc 0.5000" in ln for ln in lines)


def test_rich_bar_on_a_terminal():
    out = TTY()
    drive(ProgressBar(stream=out, refresh_s=0.0), FakeTrainer())
    text = out.getvalue()
    assert "epoch 0" in text and "20/20" in text and "loss 0.2500" in text and "scale 1024" in text
    assert "val/acc 0.5000" in text


def test_silent_off_rank_zero():
    out = io.StringIO()
    drive(ProgressBar(stream=out), FakeTrainer(rank0=False))
    assert out.getvalue() == ""


def test_token_batches_log_tokens_per_sec():
    trainer = FakeTrainer()
    ids = {"input_ids": torch.zeros(4, 128, dtype=torch.long), "labels": torch.zeros(4, 128, dtype=torch.long)}
    out = io.StringIO()
    drive(ProgressBar(stream=out), trainer, batch=ids)
    assert [s for s, _ in trainer.logged] == [5, 10, 15, 20]
    assert trainer.logged[0][1]["tokens_per_sec"] == 100.0 * 128
    assert "tok/s" in out.getvalue()


def test_format_time():
    assert _fmt_time(65) == "1:05" and _fmt_time(3725) == "1:02:05" and _fmt_time(float("nan")) == "?"
