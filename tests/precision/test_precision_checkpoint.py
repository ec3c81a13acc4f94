"""Checkpoints hold fp32 weights (the masters), load_from_checkpoint gives them back, and a resume
rebuilds the masters bitwise: a split run equals the uninterrupted one."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from _models import Classifier, mlp
from _plain_lightning import loader, trainer
from mptrain.precision import MasterPrecision, precision_plugin


class Net(Classifier):
    def __init__(self, lr: float = 1e-2):
        super().__init__(mlp(), lr=lr)
        self.save_hyperparameters()


def _fit(name, tmp_path, max_epochs, ckpt_path=None):
    torch.manual_seed(0)
    model = Net()
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0, "growth_interval": 3}
                              if name.startswith("16-") else None)
    t = trainer(plugin, max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=str(tmp_path),
                callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1)])
    t.fit(model, loader(n=128, bs=32), ckpt_path=ckpt_path)
    return model, plugin, t


def test_checkpoint_holds_fp32_masters_and_load_from_checkpoint_gives_them(tmp_path):
    model, plugin, _ = _fit("bf16-master", tmp_path, max_epochs=1)
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    for n, p in model.named_parameters():
        assert ckpt["state_dict"][n].dtype == torch.float32
        master = plugin.master_for(p)
        assert torch.equal(ckpt["state_dict"][n], master if master is not None else p.detach())
    assert ckpt["MasterPrecision"]["initial_precision"] == "bf16-master"
    loaded = Net.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    for n, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, ckpt["state_dict"][n])


def test_weights_only_checkpoint_holds_fp32_too(tmp_path):
    model, plugin, t = _fit("bf16-master", tmp_path, max_epochs=1)
    t.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
    sd = torch.load(tmp_path / "w.ckpt", weights_only=True)["state_dict"]
    w = model.net[0].weight
    assert sd["net.0.weight"].dtype == torch.float32 and torch.equal(sd["net.0.weight"], plugin.master_for(w))


@pytest.mark.parametrize("name", ["bf16-master", "16-master", "16-mixed"])
def test_resume_rebuilds_masters_bitwise(name, tmp_path):
    full, full_plugin, _ = _fit(name, tmp_path / "a", max_epochs=2)
    _fit(name, tmp_path / "b", max_epochs=1)
    resumed, plugin, t = _fit(name, tmp_path / "b", max_epochs=2, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert t.global_step == 8
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
        m1, m2 = full_plugin.master_for(p) if name.endswith("master") else None, \
            plugin.master_for(q) if name.endswith("master") else None
        if m1 is not None:
            assert torch.equal(m1, m2), f"{n}: masters differ after resume"
    if plugin.loss_scaler is not None:
        assert plugin.loss_scaler.state_dict()["scale"] == full_plugin.loss_scaler.state_dict()["scale"]
    assert plugin.skipped_steps == full_plugin.skipped_steps


def test_resuming_with_another_precision_warns_naming_both(tmp_path):
    """mptrain's rule (tests/precision/test_mode_change.py): fp32 masters and optimizer state carry over exactly."""
    _fit("bf16-master", tmp_path, max_epochs=1)
    with pytest.warns(UserWarning, match="resuming a 'bf16-master' checkpoint in '16-master'"):
        torch.manual_seed(0)
        t = trainer(MasterPrecision("16-master"), max_epochs=2)
        t.fit(Net(), loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


def test_mid_epoch_resume_is_bitwise_with_a_stateful_loader(tmp_path):
    """Saved after step 3 of a 4-batch epoch; torchdata's StatefulDataLoader gives Lightning the position."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from _models import classification_data

    def run(max_steps, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        model = Net()
        plugin = MasterPrecision("bf16-master")
        data = StatefulDataLoader(classification_data(n=128), batch_size=32, shuffle=False)
        trainer(plugin, max_steps=max_steps, enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(
            model, data, ckpt_path=ckpt_path)
        return model, plugin

    full, full_plugin = run(7)
    run(3, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)])
    (ckpt,) = tmp_path.glob("*step=3.ckpt")
    resumed, plugin = run(7, ckpt_path=str(ckpt))
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
        if full_plugin.master_for(p) is not None:
            assert torch.equal(full_plugin.master_for(p), plugin.master_for(q)), n
