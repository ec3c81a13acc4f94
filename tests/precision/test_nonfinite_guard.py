"""Every mode, scaler or not, skips a non-finite step and stops a run that cannot progress."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from _models import Classifier, mlp
from _plain_lightning import StepRecorder, loader, trainer
from mptrain.precision import NonFiniteError, precision_plugin
from mptrain.precision.nonfinite import NonFiniteGuard

MODES = ["bf16-master", "bf16-mixed", "32-true", "bf16-true", "16-master", "16-mixed"]


def _plugin(name, **kw):
    scaler = {"init_scale": 256.0} if name in ("16-master", "16-mixed") else None
    return precision_plugin(name, loss_scaler=scaler, **kw)


@pytest.mark.parametrize("name", MODES)
def test_one_nan_step_is_skipped_and_training_goes_on(name):
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=0.1, optimizer="sgd", inf_at_steps={2})
    rec = StepRecorder()
    plugin = _plugin(name)
    t = trainer(plugin, max_steps=5, callbacks=[rec])
    t.fit(model, loader(n=160))
    assert rec.unchanged(2)
    assert not any(rec.unchanged(k) for k in (0, 1, 3, 4))
    assert plugin.skipped_steps == 1 and t.global_step == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


class NanLossFiniteGrads(Classifier):
    """A NaN that reaches the loss but not the gradients (a detached term)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step >= 1:
            loss = loss + torch.tensor(float("nan")).detach()
        return loss


@pytest.mark.parametrize("name", ["bf16-master", "32-true", "bf16-mixed"])
def test_persistent_nan_raises_naming_step_scale_and_parameter(name):
    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps=set(range(1, 100)))
    with pytest.raises(NonFiniteError) as err:
        trainer(_plugin(name, max_consecutive_skips=3), max_steps=20).fit(model, loader(n=640))
    msg = str(err.value)
    assert "3 optimizer steps in a row" in msg and "at step 3" in msg and "no loss scaler" in msg
    assert "'net.0.weight'" in msg and repr(name) in msg


def test_a_nan_loss_with_finite_grads_is_caught_too():
    torch.manual_seed(0)
    model = NanLossFiniteGrads(mlp())
    with pytest.raises(NonFiniteError, match="the loss itself is non-finite"):
        trainer(_plugin("bf16-master", max_consecutive_skips=2), max_steps=10).fit(model, loader(n=640))


def test_a_checkpoint_with_nonfinite_weights_is_written_with_a_warning():
    """Lightning writes it; the warning names the weight."""
    plugin = precision_plugin("bf16-master")
    plugin.on_save_checkpoint({"state_dict": {"net.0.weight": torch.ones(2)}})
    with pytest.warns(UserWarning, match="'net.4.bias' holds inf/NaN"):
        plugin.on_save_checkpoint({"state_dict": {"net.0.weight": torch.ones(2),
                                                  "net.4.bias": torch.tensor([0.0, float("nan")])}})


def test_guard_reads_the_device_lazily():
    """On a GPU the counter is read once every check_every steps, not per step (CPU reads are free)."""
    guard = NonFiniteGuard(max_consecutive_skips=100)
    assert guard.check_every == 25
    reads = []
    guard.consecutive = torch.zeros((), dtype=torch.int32, device="meta")  # stands in for a GPU tensor
    guard.total = torch.zeros((), dtype=torch.int64, device="meta")

    def describe(skips):
        return "x"

    for step in range(1, 51):
        guard.steps = step
        try:
            guard.check(describe)
        except (NotImplementedError, RuntimeError):  # a meta tensor cannot be read: that is a read attempt
            reads.append(step)
    assert reads == [25, 50]


@pytest.mark.parametrize("name", ["bf16-master", "32-true"])
def test_torch_fused_optimizer_skips_on_the_device(name, monkeypatch):
    """torch's fused=True optimizers take found_inf as an attribute: the step is skipped inside the kernel,
    the plugin never reads the flag on the host."""
    import mptrain.precision.grads as G

    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps={1})
    model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    host_reads = []
    real = G.step_with_found_inf

    def spy(optimizer, found_inf, *a, **k):
        assert G.accepts_device_found_inf(optimizer)
        item = found_inf.item
        found_inf = found_inf.clone()
        found_inf.item = lambda: host_reads.append(1) or item()  # noqa: B023
        return real(optimizer, found_inf, *a, **k)

    monkeypatch.setattr(G, "step_with_found_inf", spy)
    rec = StepRecorder()
    plugin = _plugin(name)
    trainer(plugin, max_steps=3, callbacks=[rec]).fit(model, loader())
    assert rec.unchanged(1) and not rec.unchanged(0) and not rec.unchanged(2)
    assert plugin.skipped_steps == 1 and not host_reads
    assert all(int(st["step"]) == 2 for st in model.trainer.optimizers[0].state.values())  # AdamW skipped one


@pytest.mark.parametrize("name,opt", [("bf16-master", "mptrain"), ("16-master", "mptrain"), ("bf16-master", "torch"),
                                      ("16-mixed", "torch"), ("32-true", "torch")])
def test_no_host_read_per_step_with_fused_optimizers(name, opt, monkeypatch):
    """What a GPU run pays: no .item()/bool()/int()/float() of a tensor in mptrain.precision per step, except the
    guard's read every check_every steps (reads are free on the CPU, so they are declared not free here)."""
    import os
    import sys

    from mptrain.optim import FusedAdamW

    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps={3})
    model.configure_optimizers = (lambda: FusedAdamW(model.parameters(), lr=1e-2)) if opt == "mptrain" else \
        (lambda: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    plugin = _plugin(name)
    plugin.guard.free_reads = False
    plugin.guard.check_every = 4
    reads = []
    precision_dir = os.path.dirname(plugin_file())

    def counting(method):
        def read(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(precision_dir):
                reads.append((plugin.guard.steps, f"{os.path.basename(caller)}:{sys._getframe(1).f_lineno}"))
            return method(self, *a, **k)
        return read

    for attr in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, attr, counting(getattr(torch.Tensor, attr)))
    snaps = {}

    class Snap(Callback):  # reads nothing on the host
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snaps[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    trainer(plugin, max_steps=9, callbacks=[Snap()]).fit(model, loader(n=320))
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(snaps[3], snaps[4])) and plugin.skipped_steps == 1
    # the guard's reads at steps 4 and 8 only (guard.steps counts after the update)
    assert sorted({step for step, _ in reads}) == [4, 8], reads
    assert len(reads) == 2, reads


def plugin_file():
    import mptrain.precision.plugin as module

    return module.__file__
