"""What mptrain's Trainer cannot do must fail at setup with an error naming the argument and the
fix, before a single training step runs -- never a silent difference from lightning.Trainer."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

from compat_modules import CompatModule
from compat_run import assert_identical, base_kwargs, run


def _fit_refused(tmp_path, match: str, **trainer_kwargs) -> CompatModule:
    """fit (or the constructor) raises an error matching ``match`` before any training step."""
    import mptrain

    model = CompatModule()
    with pytest.raises(Exception, match=match):
        trainer = mptrain.Trainer(**{**base_kwargs(tmp_path), "max_steps": 2, **trainer_kwargs})
        trainer.fit(model)
    assert "training_step" not in model.calls, "the error came after training had started"
    return model


def test_unknown_precision_names_the_valid_ones(tmp_path):
    _fit_refused(tmp_path, r"(?s)fp8.*bf16-master", precision="fp8")


def test_precision_and_a_precision_plugin_together(tmp_path):
    _fit_refused(tmp_path, r"(?i)precision", precision="bf16-master",
                 plugins=[LightningMixedPrecision("bf16-mixed", "cpu")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_graphs_without_cuda(tmp_path):
    _fit_refused(tmp_path, r"cuda_graphs", precision="bf16-master", cuda_graphs=True)


class ManualModule(CompatModule):
    """Manual optimization: ``manual_backward`` and ``optimizer.step()`` in the training step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0)
        opt.step()
        if self.trainer.is_last_batch:
            self.lr_schedulers().step()


def _manual(tmp_path, trainer_cls, **kw):
    return run(trainer_cls, tmp_path, {}, lambda root: dict(max_epochs=3), module_cls=ManualModule, **kw)


def test_manual_optimization_32_true_is_identical(tmp_path):
    import mptrain

    ref = _manual(tmp_path / "lightning", L.Trainer)
    ours = _manual(tmp_path / "mptrain", mptrain.Trainer, precision="32-true")
    assert_identical(ref, ours)


@pytest.mark.parametrize("precision", ["bf16-master", "16-master"])
def test_manual_optimization_master_modes_train(precision, tmp_path):
    """Master modes with manual optimization: the masters are stepped through the plugin, so the
    loss falls as in 32-true."""
    import mptrain

    ours = _manual(tmp_path, mptrain.Trainer, precision=precision)
    assert ours.dtypes[0] in (torch.bfloat16, torch.float16)
    per_epoch = len(ours.losses) // 3
    first, last = sum(ours.losses[:per_epoch]), sum(ours.losses[-per_epoch:])
    assert last < 0.7 * first, (first, last)


# cuda_graphs=True captures one train step; the Lightning features it cannot follow are refused at
# setup, before the device check, so the refusals show on the CPU too.
def test_cuda_graphs_refuses_gradient_accumulation(tmp_path):
    _fit_refused(tmp_path, r"cuda_graphs=True.*accumulate_grad_batches=2", precision="bf16-master",
                 cuda_graphs=True, accumulate_grad_batches=2)


def test_cuda_graphs_refuses_manual_optimization(tmp_path):
    import mptrain

    model = ManualModule()
    with pytest.raises(Exception, match=r"cuda_graphs=True.*manual optimization"):
        mptrain.Trainer(**{**base_kwargs(tmp_path), "max_steps": 2}, precision="bf16-master",
                        cuda_graphs=True).fit(model)
    assert "training_step" not in model.calls


def test_cuda_graphs_refuses_detect_anomaly(tmp_path):
    _fit_refused(tmp_path, r"cuda_graphs=True.*detect_anomaly", precision="bf16-master", cuda_graphs=True,
                 detect_anomaly=True)
