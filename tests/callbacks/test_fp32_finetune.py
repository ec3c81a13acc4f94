"""Fp32Finetune: the late switch to 32-true (epochs or steps), the phase in checkpoints and logs."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parents[1] / "precision"))
from _models import Classifier, mlp  # noqa: E402
from _plain_lightning import loader, trainer  # noqa: E402
from mptrain.callbacks.fp32_finetune import Fp32Finetune  # noqa: E402
from mptrain.precision import MasterPrecision, precision_plugin  # noqa: E402


class PhaseLog(Callback):
    """Per optimizer step: the plugin's precision and the first Linear's dtype; masters just before the switch."""

    def __init__(self):
        self.rows = []
        self.masters_before = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        if plugin.phase == "low" and hasattr(plugin, "master_for"):
            self.masters_before = {n: plugin.master_for(p).detach().clone() for n, p in pl_module.named_parameters()
                                   if plugin.master_for(p) is not None}
        self.rows.append((trainer.global_step, trainer.precision_plugin.precision, pl_module.net[0].weight.dtype))


@pytest.mark.parametrize("name", ["bf16-master", "16-mixed", "bf16-true"])
def test_last_epoch_runs_in_fp32_with_optimizer_state_kept(name, tmp_path):
    torch.manual_seed(0)
    model = Classifier(mlp())
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0} if name == "16-mixed" else None)
    log = PhaseLog()
    switched_params = {}

    class AtSwitch(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                switched_params.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    t = trainer(plugin, max_epochs=3, callbacks=[Fp32Finetune(epochs=1), log, AtSwitch()],
                logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(model, loader(n=64, bs=16))
    assert [r[1] for r in log.rows] == [name] * 8 + ["32-true"] * 4
    assert log.rows[-1][2] == torch.float32 and plugin.phase == "fp32" and plugin.loss_scaler is None
    opt = t.optimizers[0]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert list(opt.param_groups[0]["params"]) == list(model.parameters())  # the model's own params again
    assert all(int(st["step"]) == 12 for st in opt.state.values())  # AdamW's state carried over
    if log.masters_before:  # the switch made the params the masters' exact values
        for n, m in log.masters_before.items():
            assert torch.equal(switched_params[n], m), n
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    flags = [float(r["precision_is_fp32"]) for r in rows if r.get("precision_is_fp32")]
    assert flags == [0.0] * 8 + [1.0] * 4


def test_steps_switch_in_a_step_based_run():
    torch.manual_seed(0)
    log = PhaseLog()
    t = trainer(MasterPrecision("bf16-master"), max_epochs=-1, max_steps=6, callbacks=[log, Fp32Finetune(steps=2)])
    t.fit(Classifier(mlp()), loader(n=96, bs=16))  # 6 batches an epoch: the switch is mid-epoch
    assert [r[1] for r in log.rows] == ["bf16-master"] * 4 + ["32-true"] * 2


def test_epochs_in_a_step_based_run_is_refused_at_setup():
    """A regression: it trained the whole run in fp32."""
    for max_epochs in (-1, None):
        t = trainer(MasterPrecision("bf16-master"), max_epochs=max_epochs, max_steps=6,
                    callbacks=[Fp32Finetune(epochs=1)])
        with pytest.raises(ValueError, match=r"bounded by max_steps=6.*Fp32Finetune\(steps=N\)"):
            t.fit(Classifier(mlp()), loader())
    with pytest.raises(ValueError, match="not both"):
        Fp32Finetune(epochs=1, steps=2)
    with pytest.raises(ValueError, match=r"epochs=3\) is more than the whole run \(max_epochs=2\)"):
        trainer(MasterPrecision("bf16-master"), max_epochs=2, callbacks=[Fp32Finetune(epochs=3)]).fit(
            Classifier(mlp()), loader())
    with pytest.raises(ValueError, match="needs max_steps > 0"):
        trainer(MasterPrecision("bf16-master"), max_epochs=2, callbacks=[Fp32Finetune(steps=2)]).fit(
            Classifier(mlp()), loader())


def test_refused_with_lightnings_own_precision():
    t = L.Trainer(precision="bf16-true", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, callbacks=[Fp32Finetune(epochs=1)])
    with pytest.raises(TypeError, match="Fp32Finetune needs one of mptrain's precision plugins.*HalfPrecision"):
        t.fit(Classifier(mlp()), loader())


def test_resume_after_the_switch_resumes_in_fp32(tmp_path):
    torch.manual_seed(0)
    model = Classifier(mlp())
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(MasterPrecision("bf16-master"), max_epochs=2, callbacks=[Fp32Finetune(epochs=1), ckpt],
            enable_checkpointing=True).fit(model, loader(n=64, bs=16))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["MasterPrecision"]["phase"] == "fp32"
    # a fresh run without the callback: the plugin's checkpoint state alone switches it
    torch.manual_seed(0)
    resumed = Classifier(mlp())
    plugin = MasterPrecision("bf16-master")
    log = PhaseLog()
    trainer(plugin, max_epochs=3, callbacks=[log]).fit(resumed, loader(n=64, bs=16), ckpt_path=str(tmp_path / "last.ckpt"))
    assert plugin.precision == "32-true" and all(r[1] == "32-true" for r in log.rows) and len(log.rows) == 4
    assert resumed.net[0].weight.dtype == torch.float32
