"""``mptrain.Trainer`` behaves as ``lightning.pytorch.Trainer`` where a user project can tell: pickling, resuming a
checkpoint of lightning.Trainer, the resume of validation and loaders, ``ckpt_path``, the optimizer closure,
precision strings mptrain does not own, and saving non-finite weights.  (``dev/lightning_conformance.py`` runs
Lightning's own test suite under both trainers; these are the causes it found, each written down once.)"""
from __future__ import annotations

import pickle
from unittest.mock import Mock, call

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from mptrain import Trainer


def _quiet(**kw):
    kw = dict(dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False), **kw)
    return Trainer(**kw)


def _loader(n=64, batch_size=8, **kw):
    return torch.utils.data.DataLoader(classification_data(n=n), batch_size=batch_size, **kw)


# -- pickling ------------------------------------------------------------------------------------------------------
def test_the_trainer_pickles_before_and_after_fit(tmp_path):
    trainer = _quiet(max_steps=2, default_root_dir=str(tmp_path))
    pickle.dumps(trainer)
    trainer.fit(Classifier(mlp()), _loader(shuffle=True), _loader())
    restored = pickle.loads(pickle.dumps(trainer))
    assert restored.global_step == 2
    torch.save(trainer, tmp_path / "trainer.pt")


@pytest.mark.slow
def test_ddp_spawn_trains_and_hands_the_weights_back(tmp_path):
    model = Classifier(mlp())
    trainer = _quiet(max_steps=2, strategy="ddp_spawn", devices=2, default_root_dir=str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, _loader(shuffle=True))
    assert trainer.state.finished
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the spawned run's weights


# -- resuming a checkpoint of lightning.Trainer ------------------------------------------------------------------
def test_a_lightning_checkpoint_resumes_as_lightning_resumes_it_with_a_warning(tmp_path):
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=str(tmp_path))
    L.Trainer(max_epochs=1, **common).fit(Classifier(mlp()), _loader(shuffle=True))
    saved = next((tmp_path / "checkpoints").glob("*.ckpt"))
    trainer = Trainer(max_epochs=2, **common)
    with pytest.warns(UserWarning, match="holds no ResumeState.*resumed as Lightning resumes it"):
        trainer.fit(Classifier(mlp()), _loader(shuffle=True), ckpt_path=str(saved))
    assert trainer.global_step == 16 and trainer.current_epoch == 2


# -- resume: validation and loaders ---------------------------------------------------------------------------------
class _FailsInValidation(Classifier):
    def __init__(self, fail: bool):
        super().__init__(mlp())
        self.fail = fail
        self.val_batches = 0

    def validation_step(self, batch, batch_idx):
        if self.fail and batch_idx == 1:
            raise RuntimeError("crash inside validation")
        self.val_batches += 1
        return super().validation_step(batch, batch_idx)


def test_a_crash_in_end_of_epoch_validation_resumes_the_rest_of_that_validation(tmp_path):
    def trainer():
        return _quiet(max_epochs=1, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
                      enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(tmp_path)])

    with pytest.raises(RuntimeError, match="crash inside validation"):
        trainer().fit(_FailsInValidation(True), _loader(n=32), _loader(n=32))
    model = _FailsInValidation(False)
    resumed = trainer()
    resumed.fit(model, _loader(n=32), _loader(n=32), ckpt_path=str(tmp_path / "on_exception.ckpt"))
    progress = resumed.fit_loop.epoch_loop.val_loop.batch_progress
    assert model.val_batches == 3  # batches 1-3 of 4: Lightning goes back and finishes the validation
    assert progress.total.completed == 4 and progress.current.completed == 4


def test_the_users_sampler_is_kept_and_its_epoch_set_once_an_epoch():
    data = classification_data(n=16)
    for batched in (False, True):
        sampler = torch.utils.data.RandomSampler(data)
        sampler.set_epoch = Mock()
        loader = (torch.utils.data.DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 4, True))
                  if batched else torch.utils.data.DataLoader(data, sampler=sampler, batch_size=4))
        trainer = _quiet(max_epochs=2, limit_train_batches=1)
        trainer.fit(Classifier(mlp()), loader)
        used = trainer.train_dataloader
        assert (used.batch_sampler.sampler if batched else used.sampler) is sampler
        assert sampler.set_epoch.mock_calls == [call(0), call(1)]


def test_an_empty_train_loader_trains_nothing():
    trainer = _quiet(max_epochs=2)
    trainer.fit(Classifier(mlp()), _loader(n=4, batch_size=8, drop_last=True))
    assert trainer.global_step == 0


def test_fit_loop_state_round_trips_after_an_exception(tmp_path):
    class Fails(Classifier):
        def training_step(self, batch, batch_idx):
            if self.trainer.current_epoch == 1 and batch_idx == 1:
                raise RuntimeError("stop")
            return super().training_step(batch, batch_idx)

    trainer = _quiet(max_epochs=3, limit_train_batches=3, default_root_dir=str(tmp_path), enable_checkpointing=True,
                     callbacks=[OnExceptionCheckpoint(tmp_path)])
    with pytest.raises(RuntimeError, match="stop"):
        trainer.fit(Fails(mlp()), _loader())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)["loops"]["fit_loop"]
    now = trainer.fit_loop.state_dict()
    assert {k: v for k, v in saved.items() if k != "state_dict"} == {k: v for k, v in now.items()
                                                                      if k != "state_dict"}


# -- ckpt_path -------------------------------------------------------------------------------------------------------
def test_a_missing_ckpt_path_is_a_file_not_found_error():
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: not existing"):
        _quiet(max_steps=1).fit(Classifier(mlp()), _loader(), ckpt_path="not existing")


# -- the optimizer closure ---------------------------------------------------------------------------------------------
class _NeedsClosure(torch.optim.SGD):
    """An optimizer whose step requires the closure (as some line-search optimizers do)."""

    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
        super().step()
        return loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "bf16-master"])
def test_the_closure_runs_inside_optimizer_step(precision):
    order = []

    class Recorder(Classifier):
        def training_step(self, batch, batch_idx):
            order.append("training_step")
            return super().training_step(batch, batch_idx)

        def backward(self, loss, *args, **kwargs):
            order.append("backward")
            super().backward(loss, *args, **kwargs)

        def on_before_optimizer_step(self, optimizer):
            order.append("on_before_optimizer_step")

        def configure_optimizers(self):
            optimizer = _NeedsClosure(self.parameters(), lr=0.1)
            step = optimizer.step

            def recorded(closure):
                order.append("step")
                return step(closure)

            optimizer.step = recorded
            return optimizer

    model = Recorder(mlp())
    _quiet(precision=precision, max_steps=2).fit(model, _loader())
    assert order == ["step", "training_step", "backward", "on_before_optimizer_step"] * 2


def test_lbfgs_trains_in_a_mode_without_master_weights():
    class WithLBFGS(Classifier):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    model = WithLBFGS(mlp())
    _quiet(max_steps=2).fit(model, _loader())
    assert len(model.losses) > 2  # LBFGS runs the closure several times a step


# -- precision strings ---------------------------------------------------------------------------------------------------
def test_lightning_only_precisions_get_lightning_plugins():
    from lightning.pytorch.plugins.precision import DoublePrecision

    assert type(_quiet(precision="64-true").precision_plugin) is DoublePrecision
    assert type(_quiet(precision=64).precision_plugin) is DoublePrecision
    with pytest.raises(ValueError, match="Lightning's own mode.*loss_scaler"):
        _quiet(precision="64-true", loss_scaler={"init_scale": 2.0})


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_half_true_modes_build_configure_model_layers_in_the_half_dtype(precision, dtype):
    made = []

    class Late(Classifier):
        def __init__(self):
            super().__init__(torch.nn.Identity())

        def configure_model(self):
            if isinstance(self.net, torch.nn.Identity):
                self.net = mlp()
                made.append(self.net[0].weight.dtype)

    _quiet(precision=precision, max_steps=1).fit(Late(), _loader())
    assert made == [dtype]


# -- non-finite weights --------------------------------------------------------------------------------------------------
def test_save_checkpoint_with_nan_weights_writes_it_with_a_warning(tmp_path):
    model = Classifier(mlp())
    trainer = _quiet(max_steps=1)
    trainer.fit(model, _loader())
    with torch.no_grad():
        model.net[0].weight.fill_(float("nan"))
    with pytest.warns(UserWarning, match="'net.0.weight' holds inf/NaN"):
        trainer.save_checkpoint(tmp_path / "nan.ckpt")
    assert torch.load(tmp_path / "nan.ckpt", weights_only=True)["state_dict"]["net.0.weight"].isnan().all()


def test_fit_loop_state_round_trips_a_loaded_loader_state(tmp_path):
    """A stateful train loader's saved position survives ``fit_loop.load_state_dict`` + ``state_dict`` (Lightning
    reports its live loaders' state instead)."""
    trainer = _quiet(max_steps=3, default_root_dir=str(tmp_path))
    trainer.fit(Classifier(mlp()), _loader(shuffle=True))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=True)["loops"]["fit_loop"]
    assert saved["state_dict"]["combined_loader"][0]["_num_yielded"] == 3
    trainer.fit_loop.load_state_dict(saved)
    assert trainer.fit_loop.state_dict()["state_dict"]["combined_loader"] == saved["state_dict"]["combined_loader"]


def test_a_checkpoint_written_in_the_last_batchs_validation_resumes_the_loops_of_the_straight_run(tmp_path):
    """val_check_interval equal to the epoch's length: ModelCheckpoint saves in that validation, before Lightning
    counts the batch as stepped; the resumed run ends with the straight run's loop state (logger step included)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_epochs, root, ckpt_path=None):
        trainer = _quiet(max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=2, val_check_interval=2,
                         enable_checkpointing=True,
                         callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1)])
        trainer.fit(Classifier(mlp()), _loader(), _loader(n=16), ckpt_path=ckpt_path)
        return torch.load(root / "last.ckpt", weights_only=True)["loops"]["fit_loop"]

    straight = fit(4, tmp_path / "straight")
    fit(2, tmp_path / "resumed")
    resumed = fit(4, tmp_path / "resumed", ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    assert resumed["epoch_loop.state_dict"] == straight["epoch_loop.state_dict"]
    assert resumed["epoch_loop.batch_progress"] == straight["epoch_loop.batch_progress"]
    assert resumed["epoch_progress"] == straight["epoch_progress"]


def test_an_iterable_dataset_resumed_at_an_epochs_end_is_iterated_once_an_epoch(tmp_path):
    """As under Lightning: one iterator per epoch, none extra at the resume (a dataset reading an external source
    would lose what an extra iterator read)."""

    class Counted(torch.utils.data.IterableDataset):
        iterations = 0

        def __iter__(self):
            type(self).iterations += 1
            data = classification_data(n=16)
            return iter([data[i] for i in range(len(data))])

    def fit(max_epochs, ckpt_path=None):
        Counted.iterations = 0
        trainer = _quiet(max_epochs=max_epochs, default_root_dir=str(tmp_path))
        trainer.fit(Classifier(mlp()), torch.utils.data.DataLoader(Counted(), batch_size=8), ckpt_path=ckpt_path)
        return trainer

    fit(2).save_checkpoint(tmp_path / "after_fit.ckpt")
    assert Counted.iterations == 2
    assert fit(4, ckpt_path=str(tmp_path / "after_fit.ckpt")).current_epoch == 4
    assert Counted.iterations == 2
