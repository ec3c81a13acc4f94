"""OverflowMonitor: per-layer overflow/underflow fractions through any Lightning logger."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "precision"))
from _plain_lightning import trainer  # noqa: E402
from mptrain.callbacks.overflow_monitor import OverflowMonitor  # noqa: E402
from mptrain.precision import precision_plugin  # noqa: E402


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w  # autocast leaves mul in fp32: the grad of w stays fp32


class Hot(L.LightningModule):
    """``big`` outputs values near fp16's max (never inf); ``tiny``'s grads fall below fp16's smallest subnormal."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(4, 4)
        self.tiny = Scale()
        with torch.no_grad():
            self.big.weight.fill_(0.0)
            self.big.bias.fill_(40000.0)  # 0.5 * 65504 < 40000 < 65504

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.big(x)
        return self.tiny(x.float()).sum() * 1e-12 + h.float().mean() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_fractions_reach_the_logger_per_layer(tmp_path):
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=8)
    plugin = precision_plugin("16-mixed", loss_scaler={"init_scale": 1.0})
    t = trainer(plugin, max_steps=4, logger=CSVLogger(tmp_path), callbacks=[OverflowMonitor(every_n_steps=2)])
    t.fit(Hot(), data)
    rows = [r for r in csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))) if r.get("overflow/big/out_near_max")]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert all(float(r["overflow/big/out_near_max"]) == 1.0 for r in rows)  # every output of big
    assert all(float(r["overflow/big/out_nonfinite"]) == 0.0 for r in rows)
    assert all(float(r["overflow/tiny/out_near_max"]) == 0.0 for r in rows)
    # tiny's grad is ~1e-12 (x scale 1): below 2**-24, it would flush to zero in fp16
    assert all(float(r["overflow/tiny/grad_underflow"]) > 0 for r in rows)
    assert all(float(r["overflow/big/grad_nonfinite"]) == 0.0 for r in rows)


def test_refused_with_lightnings_own_precision():
    t = L.Trainer(precision="32-true", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                  callbacks=[OverflowMonitor()])
    with pytest.raises(TypeError, match="OverflowMonitor needs one of mptrain's precision plugins"):
        t.fit(Hot(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=8))
    with pytest.raises(ValueError, match="every_n_steps=0"):
        OverflowMonitor(every_n_steps=0)
