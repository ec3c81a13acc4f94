"""Checkpoints: exact mid-epoch resume, atomic writes, safe loads."""
from __future__ import annotations

import os

import pytest
import torch

from _models import Classifier, classification_data, mlp, quiet_trainer
from mptrain import CheckpointError
from mptrain import checkpoint as ckpt_mod


class Crash(Exception):
    pass


class CrashAt:
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash(f"simulated crash at step {self.step}")


class LossLog:
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[(trainer.current_epoch, batch_idx)] = outputs["loss"].clone()


def _run(precision, root, crash_at=None, ckpt_path=None, every=None):
    torch.manual_seed(1234)
    model = Classifier(mlp(dropout=0.3), lr=3e-3)
    loader = torch.utils.data.DataLoader(classification_data(n=200), batch_size=16, shuffle=True)
    rec = LossLog()
    cbs = [rec] + ([CrashAt(crash_at)] if crash_at is not None else [])
    trainer = quiet_trainer(precision=precision, max_epochs=3, accumulate_grad_batches=2, seed=7,
                            default_root_dir=str(root), enable_checkpointing=True,
                            checkpoint_every_n_steps=every, callbacks=cbs)
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except Crash:
        pass
    return model, rec.losses, trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_resume_mid_epoch_is_bitwise_identical(precision, tmp_path):
    full_model, full_losses, full = _run(precision, tmp_path / "full")
    # 13 batches an epoch -> 7 steps an epoch; crash in the middle of epoch 1 after a checkpoint at step 10
    _, part_losses, part = _run(precision, tmp_path / "part", crash_at=11, every=5)
    assert part.global_step == 11
    assert (tmp_path / "part" / "checkpoints" / "step-10.ckpt").is_file()
    state = torch.load(tmp_path / "part" / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 10 and state["epoch"] == 1 and 0 < state["batch_idx"] < 13
    res_model, res_losses, res = _run(precision, tmp_path / "part", ckpt_path="last")
    assert res.global_step == full.global_step
    assert len(res_losses) > 10
    for key, loss in res_losses.items():
        assert torch.equal(loss, full_losses[key]), f"loss differs at (epoch, batch) {key}"
    for (n, a), b in zip(full_model.state_dict().items(), res_model.state_dict().values()):
        assert torch.equal(a, b), n


def test_failure_inside_save_leaves_previous_last_loadable(tmp_path, monkeypatch):
    model = Classifier(mlp())
    loader = torch.utils.data.DataLoader(classification_data(n=64), batch_size=16)
    trainer = quiet_trainer(max_steps=4, default_root_dir=str(tmp_path), enable_checkpointing=True)
    trainer.fit(model, loader)
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    real_save = torch.save

    def broken_save(obj, f, *a, **k):
        real_save({"partial": torch.zeros(1000)}, f)  # some bytes reach the temp file ...
        raise OSError("disk full (simulated)")  # ... then the write fails

    monkeypatch.setattr(ckpt_mod.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(last)
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    assert last.read_bytes() == before
    assert ckpt_mod.load_checkpoint(last)["global_step"] == 4
    assert [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")] == []


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('MPT_PWNED', '/tmp/mpt_pwned')}",))


def test_pickle_payload_is_refused_and_never_runs(tmp_path, monkeypatch):
    flag = tmp_path / "pwned"
    monkeypatch.setenv("MPT_PWNED", str(flag))
    bad = tmp_path / "evil.ckpt"
    torch.save({"format": 1, "state_dict": {}, "optimizer": {}, "epoch": 0, "global_step": 0, "batch_idx": 0,
                "precision": "32-true", "x": Payload()}, bad)
    model = Classifier(mlp())
    loader = torch.utils.data.DataLoader(classification_data(n=32), batch_size=16)
    with pytest.raises(CheckpointError, match="evil.ckpt.*refused|refused.*evil.ckpt"):
        quiet_trainer(max_steps=1).fit(model, loader, ckpt_path=str(bad))
    assert not flag.exists()


def test_missing_and_truncated_checkpoints_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="nope.ckpt.*does not exist"):
        ckpt_mod.load_checkpoint(tmp_path / "nope.ckpt")
    model = Classifier(mlp())
    loader = torch.utils.data.DataLoader(classification_data(n=64), batch_size=16)
    quiet_trainer(max_steps=2, default_root_dir=str(tmp_path), enable_checkpointing=True).fit(model, loader)
    data = (tmp_path / "checkpoints" / "last.ckpt").read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.ckpt.*truncated"):
        ckpt_mod.load_checkpoint(cut)
    with pytest.raises(CheckpointError, match="last.ckpt"):
        quiet_trainer(max_steps=1, default_root_dir=str(tmp_path / "empty")).fit(model, loader, ckpt_path="last")


def test_last_ckpt_after_max_steps_mid_epoch_resumes_there(tmp_path):
    """fit stopped by max_steps in the middle of an epoch: last.ckpt records that position."""
    loader = torch.utils.data.DataLoader(classification_data(n=160), batch_size=16)  # 10 batches an epoch
    model = Classifier(mlp())
    quiet_trainer(max_steps=13, default_root_dir=str(tmp_path), enable_checkpointing=True).fit(model, loader)
    state = ckpt_mod.load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert (state["epoch"], state["batch_idx"], state["global_step"]) == (1, 3, 13)
    t = quiet_trainer(max_steps=20, default_root_dir=str(tmp_path), enable_checkpointing=True)
    t.fit(Classifier(mlp()), loader, ckpt_path="last")
    assert t.global_step == 20 and t.current_epoch == 2
    full = quiet_trainer(max_epochs=2, default_root_dir=str(tmp_path / "b"), enable_checkpointing=True)
    full.fit(Classifier(mlp()), loader)
    state = ckpt_mod.load_checkpoint(tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert (state["epoch"], state["batch_idx"], state["global_step"]) == (2, 0, 20)
