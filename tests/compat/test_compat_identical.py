"""The same LightningModule under ``lightning.Trainer`` and ``mptrain.Trainer(precision="32-true")``
with the same seed: identical hook order, metrics, weights, files and checkpoint contents."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from compat_modules import CompatDataModule, CompatModule
from compat_run import assert_identical, assert_same_values, run


def _checkpoint_top2(root):
    return ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{step}-{val_loss:.4f}")


CASES = {
    # self.log flavours, Metric objects, every hook, StepLR per epoch, top-k checkpoints, LR monitor
    "logging_hooks_topk_lrmonitor": (
        {"scheduler": "steplr_epoch"},
        lambda root: dict(max_epochs=3, callbacks=[_checkpoint_top2(root), LearningRateMonitor("step")])),
    "plateau_with_monitor": (
        {"scheduler": "plateau"},
        lambda root: dict(max_epochs=3, callbacks=[LearningRateMonitor("epoch")])),
    "steplr_interval_step": (
        {"scheduler": "steplr_step"},
        lambda root: dict(max_epochs=2, callbacks=[LearningRateMonitor("step")])),
    "steplr_with_monitor_key": (
        {"scheduler": "steplr_monitor"},
        lambda root: dict(max_epochs=3, callbacks=[LearningRateMonitor("epoch")])),
    "early_stopping": (
        {},
        lambda root: dict(max_epochs=8, callbacks=[EarlyStopping(monitor="const", patience=1)])),
    "fractional_limits_val_check_interval": (
        {},
        lambda root: dict(max_epochs=2, limit_train_batches=0.5, limit_val_batches=0.25, val_check_interval=0.5)),
    "accumulate_clip_norm": (
        {"lr": 0.2},
        lambda root: dict(max_epochs=2, accumulate_grad_batches=3, gradient_clip_val=0.05)),
    "clip_value_max_steps": (
        {"lr": 0.2},
        lambda root: dict(max_steps=11, gradient_clip_val=0.01, gradient_clip_algorithm="value")),
    "fast_dev_run": (
        {},
        lambda root: dict(fast_dev_run=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fit_is_identical_to_lightning(case, tmp_path):
    import mptrain

    module_kwargs, trainer_kwargs = CASES[case]
    ref = run(L.Trainer, tmp_path / "lightning", module_kwargs, trainer_kwargs)
    ours = run(mptrain.Trainer, tmp_path / "mptrain", module_kwargs, trainer_kwargs, precision="32-true")
    assert ref.global_step > 0 and ref.calls.count("training_step") > 0  # the case trained at all
    assert_identical(ref, ours)


def test_case_features_take_effect(tmp_path):
    """The cases above exercise what they claim (so "identical" is not "both did nothing")."""
    es = run(L.Trainer, tmp_path / "es", *CASES["early_stopping"])
    assert es.current_epoch < 8
    plateau = run(L.Trainer, tmp_path / "plateau", *CASES["plateau_with_monitor"])
    lrs = [float(r["lr-SGD"]) for r in plateau.csv_rows if r.get("lr-SGD")]
    assert lrs[0] == 0.05 and min(lrs) < 0.05
    limits = run(L.Trainer, tmp_path / "limits", *CASES["fractional_limits_val_check_interval"])
    assert limits.calls.count("training_step") == 2 * 4 and limits.calls.count("on_validation_start") == 1 + 2 * 2
    topk = run(L.Trainer, tmp_path / "topk", *CASES["logging_hooks_topk_lrmonitor"])
    assert len(topk.checkpoints) == 2 and [s for _, s in topk.seen][-1] == 23


def _test_predict_reload(trainer, model, extra):
    extra["test"] = trainer.test(model, verbose=False)
    extra["predict"] = trainer.predict(model)
    best = trainer.checkpoint_callback.best_model_path
    reloaded = CompatModule.load_from_checkpoint(best)
    extra["reloaded_hparams"] = dict(reloaded.hparams)
    extra["reloaded_weights"] = reloaded.state_dict()
    extra["test_calls"] = model.calls[model.calls.index("test_dataloader") - 1:]


def test_test_predict_and_load_from_checkpoint(tmp_path):
    import mptrain

    kwargs = lambda root: dict(max_epochs=2, callbacks=[ModelCheckpoint(monitor="val_loss")])  # noqa: E731
    ref = run(L.Trainer, tmp_path / "lightning", {}, kwargs, _test_predict_reload)
    ours = run(mptrain.Trainer, tmp_path / "mptrain", {}, kwargs, _test_predict_reload, precision="32-true")
    assert len(ref.extra["predict"]) == 2 and "test_loss" in ref.extra["test"][0]
    assert_identical(ref, ours)
    best = next(f for f in ours.files if f.endswith(".ckpt"))
    assert_same_values(ours.checkpoints[best]["state_dict"], ours.extra["reloaded_weights"], "reloaded")


def _test_and_predict(trainer, model, extra):
    extra["test"] = trainer.test(model, datamodule=trainer.datamodule, verbose=False)
    extra["predict"] = trainer.predict(model, datamodule=trainer.datamodule)


def test_datamodule_is_identical(tmp_path):
    """A LightningDataModule's hooks (prepare_data, setup, loaders, state_dict, batch transfer,
    teardown) are called as under Lightning, and its loaders feed fit, test and predict."""
    import mptrain

    kwargs = lambda root: dict(max_epochs=2, callbacks=[ModelCheckpoint(monitor="val_loss")])  # noqa: E731
    ref = run(L.Trainer, tmp_path / "lightning", {}, kwargs, _test_and_predict, datamodule_cls=CompatDataModule)
    ours = run(mptrain.Trainer, tmp_path / "mptrain", {}, kwargs, _test_and_predict, precision="32-true",
               datamodule_cls=CompatDataModule)
    assert "state_dict" in ref.extra["datamodule_calls"] and "train_dataloader" in ref.extra["datamodule_calls"]
    assert len(ref.extra["predict"]) == 1
    assert_identical(ref, ours)


def test_default_precision_is_lightnings(tmp_path):
    """Without a precision argument mptrain's Trainer runs 32-true, as Lightning does."""
    import mptrain

    kwargs = lambda root: dict(max_steps=4, limit_val_batches=1)  # noqa: E731
    ref = run(L.Trainer, tmp_path / "lightning", {}, kwargs)
    ours = run(mptrain.Trainer, tmp_path / "mptrain", {}, kwargs)
    assert_identical(ref, ours)
    assert all(t.dtype == torch.float32 for t in ours.weights.values() if t.is_floating_point())
