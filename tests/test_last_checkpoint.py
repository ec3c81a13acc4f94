"""``fit(ckpt_path="last")`` resumes the newest "last" checkpoint of the run's root, across the logger's versions;
without one, Lightning warns and starts a new run."""
from __future__ import annotations

import os

import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.loggers import CSVLogger

from mptrain import Trainer


def _fit(root, max_steps, logger, ckpt_path=None, **kw):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.2), lr=1e-2)
    logger = CSVLogger(str(root)) if logger == "csv" else logger
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, default_root_dir=str(root), logger=logger, seed=0,
                      enable_progress_bar=False, enable_model_summary=False, checkpoint_every_n_steps=4, **kw)
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=64), batch_size=8, shuffle=True),
                ckpt_path=ckpt_path)
    return trainer, torch.stack(model.losses)


@pytest.mark.parametrize("logger", [True, "csv"])  # the default logger (TensorBoard or CSV), a CSVLogger
def test_ckpt_path_last_finds_previous_version(tmp_path, logger):
    _, straight = _fit(tmp_path / "straight", 12, logger)
    _fit(tmp_path, 4, logger)  # version_0
    resumed, rest = _fit(tmp_path, 12, logger, ckpt_path="last")  # logs into version_1
    assert "version_0" in resumed.ckpt_path and os.path.basename(resumed.ckpt_path) == "last.ckpt"
    assert resumed.global_step == 12 and torch.equal(rest, straight[4:])
    again, _ = _fit(tmp_path, 16, logger, ckpt_path="last")  # the newest: version_1's, at step 12
    assert "version_1" in again.ckpt_path and torch.load(again.ckpt_path, weights_only=True)["global_step"] == 12


def test_ckpt_path_last_as_a_positional_argument(tmp_path):
    _fit(tmp_path, 4, True)
    trainer = Trainer(accelerator="cpu", max_steps=8, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      checkpoint_every_n_steps=4)
    loader = torch.utils.data.DataLoader(classification_data(n=64), batch_size=8, shuffle=True)
    trainer.fit(Classifier(mlp()), loader, None, None, "last")
    assert "version_0" in trainer.ckpt_path and trainer.global_step == 8


@pytest.mark.parametrize("logger", [True, False])
def test_ckpt_path_last_without_a_checkpoint_warns_and_starts_fresh_as_lightning(tmp_path, logger):
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        trainer, _ = _fit(tmp_path, 4, logger, ckpt_path="last")
    assert trainer.ckpt_path is None and trainer.global_step == 4


def test_ckpt_path_last_without_model_checkpoint_warns_and_starts_fresh(tmp_path):
    trainer = Trainer(accelerator="cpu", max_steps=1, default_root_dir=str(tmp_path), enable_checkpointing=False,
                      logger=False)
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        trainer.fit(Classifier(mlp()), torch.utils.data.DataLoader(classification_data(n=8)), ckpt_path="last")
    assert trainer.global_step == 1
