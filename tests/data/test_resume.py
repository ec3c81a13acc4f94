"""Deterministic resume: a run resumed mid-epoch from a checkpoint ends with the weights of the
uninterrupted run (shuffling order and per-sample randomness do not depend on the restart)."""
from __future__ import annotations

import torch

from mptrain import Trainer
from mptrain.data import DigitsDataModule
from mptrain.models import ImageClassifier


def fit(root, max_steps, ckpt_path=None, every=None):
    torch.manual_seed(0)
    model = ImageClassifier(arch="digits_cnn", optimizer="adamw", lr=3e-3, warmup_steps=5, total_steps=40)
    trainer = Trainer(precision="32-true", accelerator="cpu", max_steps=max_steps, max_epochs=-1, seed=0,
                      default_root_dir=str(root), logger=False, enable_progress_bar=False,
                      checkpoint_every_n_steps=every, limit_val_batches=1)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=64, num_workers=0), ckpt_path=ckpt_path)
    return model.state_dict()


def test_resume_mid_epoch_matches_uninterrupted(tmp_path):
    straight = fit(tmp_path / "a", 30)
    fit(tmp_path / "b", 10, every=10)  # 22 steps per epoch: step 10 is mid-epoch
    resumed = fit(tmp_path / "b", 30, ckpt_path=str(tmp_path / "b" / "checkpoints" / "step-10.ckpt"))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
