"""OverflowMonitor: names the module whose gradient went non-finite; logs per-module fractions."""
import logging
import types

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mptrain.numerics import OverflowMonitor
from mptrain.numerics.monitor import FP16_TINY


class Net(L.LightningModule):
    """``bad``'s weight gradient becomes inf on the steps listed in ``poison_steps``."""

    def __init__(self, poison_steps=()):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.bad = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.poison_steps = set(poison_steps)
        self.calls = 0
        self.bad.weight.register_hook(self._poison)

    def _poison(self, g):
        return g * float("inf") if self.calls in self.poison_steps else g

    def forward(self, x):
        return self.out(self.act(self.bad(self.act(self.inp(x)))))

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n=64):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
                      batch_size=8)


def _trainer(tmp_path, monitor, **kw):
    from mptrain import Trainer

    return Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[monitor], **kw)


def test_monitor_names_the_module_with_nonfinite_grads_in_a_real_run(tmp_path, caplog):
    monitor = OverflowMonitor(log_every_n_steps=4)
    model = Net(poison_steps={3})
    trainer = _trainer(tmp_path, monitor, precision="32-true", loss_scaler={"init_scale": 2.0**8, "hysteresis": 1},
                       log_every_n_steps=4)
    with caplog.at_level(logging.WARNING, logger="mptrain.numerics"):
        trainer.fit(model, train_dataloaders=_loader())
    assert trainer.skipped_steps == 1
    assert monitor.last_nonfinite_modules == ["bad"]
    assert monitor.history == [(3, ["bad"])]
    assert any("non-finite gradients in bad" in r.getMessage() for r in caplog.records)
    # Logged every 4 steps through trainer.log_metrics, per module.
    logged = trainer.logged_metrics
    assert "numerics/bad/grad_nonfinite" in logged and "numerics/inp/out_nonfinite" in logged
    assert "numerics/grad_underflow" in logged


def test_monitor_quiet_without_skips(tmp_path):
    monitor = OverflowMonitor(log_every_n_steps=2)
    trainer = _trainer(tmp_path, monitor, precision="32-true", log_every_n_steps=2)
    trainer.fit(Net(), train_dataloaders=_loader())
    assert monitor.last_nonfinite_modules == [] and monitor.history == []


class _FakeTrainer:
    """Just what the monitor reads: step counters, the scaler, log_metrics."""

    def __init__(self, scale):
        self.global_step = 0
        self.skipped_steps = 0
        self.logged = []

        self.loss_scaler = types.SimpleNamespace(scale_tensor=torch.tensor(scale), scale=scale)

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def test_hooks_count_outputs_grads_and_fp16_underflow_at_the_scale():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    mon = OverflowMonitor(log_every_n_steps=1)
    tr = _FakeTrainer(scale=2.0**10)
    mon.on_fit_start(tr, net)
    net.train()
    out = net(torch.randn(3, 4))
    out.sum().backward()
    with torch.no_grad():
        net[0].weight.grad.zero_()
        net[0].weight.grad[0, :2] = 2.0**-40   # * 2**10 = 2**-30 < 2**-24: would underflow in fp16
        net[0].weight.grad[1, 0] = 2.0**-10    # * 2**10 = 1: fine
        net[0].weight.grad[2, 0] = float("nan")
        net[2].weight.grad[0, 0] = 40000.0  # >= 0.5 * fp16 max: near-max
    mon.on_before_optimizer_step(tr, net, None)
    tr.global_step = 1
    tr.skipped_steps = 1
    mon.on_train_batch_end(tr, net, {"loss": torch.tensor(0.0)}, None, 0)
    assert mon.last_nonfinite_modules == ["0"]
    step, m = tr.logged[-1]
    assert step == 1
    # Module "0" owns 16 weights + 4 biases; "2" owns 8 + 2.
    assert m["numerics/0/grad_nonfinite"] == pytest.approx(1 / 20)
    assert m["numerics/0/grad_underflow"] == pytest.approx(2 / 20)
    assert m["numerics/2/grad_underflow"] == 0.0
    assert m["numerics/2/grad_near_max"] == pytest.approx(1 / 10)
    assert m["numerics/0/out_nonfinite"] == 0.0
    assert m["numerics/modules_with_nonfinite_grad"] == 1.0
    assert FP16_TINY == 2.0**-24
    # Counters reset after the flush.
    assert all(v == 0 for v in mon.metrics().values())
    mon.on_fit_end(tr, net)
    assert not mon._handles


def test_output_hook_counts_nonfinite_and_near_max_in_half():
    class Spike(nn.Module):
        def forward(self, x):
            y = x.clone()
            y[0, 0] = float("inf")
            y[0, 1] = 40000.0  # >= 0.5 * 65504
            return y

    net = nn.Sequential(nn.Linear(4, 4).half(), Spike())
    mon = OverflowMonitor(log_every_n_steps=1)
    mon.setup_module(net)
    net.train()
    net(torch.randn(2, 4).half())
    m = mon.metrics()
    assert m["numerics/1/out_nonfinite"] == pytest.approx(1 / 8)
    assert m["numerics/1/out_near_max"] == pytest.approx(1 / 8)
    assert m["numerics/modules_with_nonfinite_output"] == 1.0
    net.eval()
    net(torch.randn(2, 4).half())  # evaluation forwards are not counted
    assert mon.metrics()["numerics/1/out_nonfinite"] == pytest.approx(1 / 8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        OverflowMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="near_max_ratio"):
        OverflowMonitor(near_max_ratio=2.0)
