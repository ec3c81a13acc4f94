"""AutoFp32Fallback: the module whose output overflows is promoted to fp32 and named."""
from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "precision"))
from _plain_lightning import trainer  # noqa: E402
from mptrain.callbacks.auto_fp32_fallback import AutoFp32Fallback  # noqa: E402
from mptrain.precision import precision_plugin  # noqa: E402


class Blowup(nn.Module):
    def forward(self, x):
        return (x * 1e5) * 1e-5  # the intermediate overflows fp16 (max 65504) for |x| > 0.65


class WithBlowup(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.blow = Blowup()
        self.post = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.post(self.blow(self.pre(x))).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _data():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8) * 3), batch_size=16)


@pytest.mark.parametrize("name", ["16-master", "16-true", "16-mixed"])
def test_the_overflowing_module_is_promoted_and_named(name, tmp_path, caplog):
    torch.manual_seed(0)
    model = WithBlowup()
    plugin = precision_plugin(name, loss_scaler={"init_scale": 2.0**8} if name != "16-true" else None)
    t = trainer(plugin, max_steps=6, callbacks=[AutoFp32Fallback()], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    with caplog.at_level(logging.INFO, logger="mptrain"):
        t.fit(model, _data())
    lines = [r.getMessage() for r in caplog.records if "auto_fp32_fallback" in r.getMessage()]
    assert any("'blow'" in line and "produced inf/NaN" in line for line in lines)
    assert plugin.promoted == ["blow"]
    assert plugin.skipped_steps == 1  # the step that overflowed; clean ever after
    assert model.pre.weight.dtype == (torch.float32 if name == "16-mixed" else torch.float16)
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    assert [float(r["auto_fp32_promoted"]) for r in rows if r.get("auto_fp32_promoted")][-1] == 1.0


def test_promotions_survive_a_resume(tmp_path):
    torch.manual_seed(0)
    trainer(precision_plugin("16-master", loss_scaler={"init_scale": 2.0**8}), max_epochs=1, enable_checkpointing=True,
            callbacks=[AutoFp32Fallback(), ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(WithBlowup(), _data())
    plugin = precision_plugin("16-master", loss_scaler={"init_scale": 2.0**8})
    trainer(plugin, max_epochs=2, callbacks=[AutoFp32Fallback()]).fit(WithBlowup(), _data(),
                                                                      ckpt_path=str(tmp_path / "last.ckpt"))
    assert plugin.promoted == ["blow"] and plugin.skipped_steps == 1  # no new overflow after the resume


def test_refused_with_lightnings_own_precision():
    t = L.Trainer(precision="16-mixed", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                  callbacks=[AutoFp32Fallback()])
    with pytest.raises(TypeError, match="AutoFp32Fallback needs one of mptrain's precision plugins"):
        t.fit(WithBlowup(), _data())
