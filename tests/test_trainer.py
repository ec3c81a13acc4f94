"""mptrain.Trainer: a lightning.pytorch.Trainer whose own arguments become plugins and callbacks."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, cnn, image_data, mlp, quiet_trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy

from mptrain import (PRECISIONS, AtomicCheckpointIO, AutoFp32Fallback, ChannelsLast, CompileModel, Fp32Finetune,
                     MasterPrecision, ResumeState, Trainer)

PARAM_DTYPE = {"32-true": torch.float32, "16-mixed": torch.float32, "bf16-mixed": torch.float32,
               "16-true": torch.float16, "bf16-true": torch.bfloat16, "16-master": torch.float16,
               "bf16-master": torch.bfloat16, "bf16-sr": torch.bfloat16}


def _loader(ds, bs, shuffle=True, seed=0):
    return torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=shuffle,
                                       generator=torch.Generator().manual_seed(seed))


def _mean_loss(model, ds) -> float:
    x, y = ds.tensors
    with torch.no_grad():
        p = next(model.parameters())
        return float(torch.nn.functional.cross_entropy(model(x.to(p.dtype)).float(), y))


# fp8-master needs an fp8 GPU: its CPU refusal and plugin logic are in tests/precision/test_fp8.py
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "fp8-master"])
def test_every_precision_trains(precision):
    torch.manual_seed(0)
    ds = classification_data()
    # Adam's eps (1e-8) is zero in fp16, so 16-true (no fp32 state, as in Lightning) uses SGD.
    opt = "sgd" if precision == "16-true" else "adamw"
    model = Classifier(mlp(), lr=0.1 if opt == "sgd" else 1e-2, optimizer=opt)
    before = _mean_loss(model, ds)
    trainer = quiet_trainer(precision=precision, max_epochs=3)
    trainer.fit(model, _loader(ds, 32))
    assert trainer.global_step == 3 * math.ceil(len(ds) / 32)
    after = _mean_loss(model.eval(), ds)
    assert math.isfinite(after) and after < 0.85 * before, (precision, before, after)
    assert PARAM_DTYPE[precision] in {p.dtype for p in model.parameters()}
    assert trainer.precision == precision and isinstance(trainer, L.Trainer)


def test_lightning_aliases_are_accepted():
    assert quiet_trainer(precision=32).precision == "32-true"
    assert quiet_trainer(precision="bf16").precision == "bf16-mixed"


def test_accumulation_equals_large_batch():
    ds = classification_data(n=64)
    results = []
    for bs, accum in [(32, 1), (8, 4)]:
        torch.manual_seed(0)
        model = Classifier(mlp(), lr=0.1, optimizer="sgd")
        trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=accum)
        trainer.fit(model, _loader(ds, bs, shuffle=False))
        assert trainer.global_step == 2
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["16-mixed", "16-master"])
def test_overflow_skips_the_window_and_is_counted(precision):
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=0.1, optimizer="sgd", inf_at_batches={(0, 1)})  # inf in the first window
    trainer = quiet_trainer(precision=precision, max_steps=2, accumulate_grad_batches=2,
                            loss_scaler={"init_scale": 1024.0, "hysteresis": 1})
    assert trainer.loss_scaler is not None and trainer.skipped_steps == 0
    trainer.fit(model, _loader(classification_data(n=64), 8, shuffle=False))
    assert trainer.global_step == 2 and trainer.skipped_steps == 1
    assert trainer.loss_scaler.scale == 512.0


def test_no_loss_scaler_where_the_mode_has_none():
    trainer = quiet_trainer(precision="bf16-master")
    assert trainer.loss_scaler is None and trainer.skipped_steps == 0


def test_fp32_finetune_switches_for_the_last_epoch():
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=3e-3)
    dtypes = []

    class Spy(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            dtypes.append((trainer.precision_plugin.phase, pl_module.net[0].weight.dtype))

    trainer = quiet_trainer(precision="bf16-master", max_epochs=3, fp32_finetune_epochs=1, callbacks=[Spy()])
    assert sum(isinstance(c, Fp32Finetune) for c in trainer.callbacks) == 1
    trainer.fit(model, _loader(classification_data(n=64), 32))
    assert dtypes == [("low", torch.bfloat16)] * 2 + [("fp32", torch.float32)]


def test_fp32_finetune_steps_in_a_step_based_run():
    model = Classifier(mlp())
    trainer = quiet_trainer(precision="bf16-master", max_steps=4, fp32_finetune_steps=1)
    trainer.fit(model, _loader(classification_data(n=64), 8))
    assert trainer.global_step == 4 and model.net[0].weight.dtype == torch.float32


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(precision="fp8"), ValueError, "precision='fp8'.*32-true"),
    (dict(precision="64-true", loss_scaler={"init_scale": 2.0}), ValueError, "precision='64-true' is Lightning's"),
    (dict(fused="yes"), ValueError, "fused='yes'.*'auto', True, False"),
    (dict(precision="16-mixed", loss_scaler={"init_scal": 2}), ValueError, "init_scal.*valid keys"),
    (dict(precision="16-mixed", loss_scaler={"init_scale": -2}), ValueError, "init_scale"),
    (dict(loss_scaler={"init_scale": 4}), ValueError, "precision='32-true' uses no loss scaler"),
    (dict(fp32_fallback=["softmaxx"]), ValueError, "fp32_fallback: unknown op 'softmaxx'"),
    (dict(cuda_graphs="yes"), ValueError, "cuda_graphs='yes'.*True, False"),
    (dict(fp32_finetune_epochs=-1), ValueError, "fp32_finetune_epochs=-1.*integer >= 0"),
    (dict(max_epochs=2, fp32_finetune_epochs=3), ValueError, "fp32_finetune_epochs=3 is more than max_epochs=2"),
    (dict(max_epochs=-1, max_steps=6, fp32_finetune_epochs=1), ValueError, "epoch-based.*fp32_finetune_steps"),
    (dict(max_steps=3, fp32_finetune_steps=5), ValueError, "fp32_finetune_steps=5 needs max_steps >= 5"),
    (dict(checkpoint_every_n_steps=0), ValueError, "checkpoint_every_n_steps=0.*>= 1"),
    (dict(seed=1.5), ValueError, "seed=1.5"),
    (dict(compile="max"), ValueError, "compile='max'.*dict of torch.compile"),
    (dict(channels_last=1), ValueError, "channels_last=1"),
    (dict(plugins=[MasterPrecision("bf16-master")], precision="16-mixed"), ValueError,
     "plugins= holds a precision plugin, so precision='16-mixed'"),
])
def test_bad_arguments_name_the_argument_and_the_valid_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        Trainer(**kwargs)


def test_a_users_precision_plugin_is_used():
    model = Classifier(mlp())
    trainer = quiet_trainer(plugins=[MasterPrecision("bf16-master")], max_steps=2)
    trainer.fit(model, _loader(classification_data(n=32), 8))
    assert trainer.precision == "bf16-master" and model.net[0].weight.dtype == torch.bfloat16


def test_a_wrapping_checkpoint_io_gets_the_atomic_one_inside():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    trainer = quiet_trainer(plugins=[AsyncCheckpointIO()])
    assert isinstance(trainer.strategy.checkpoint_io.checkpoint_io, AtomicCheckpointIO)
    trainer = quiet_trainer(plugins=[TorchCheckpointIO()])  # a user's choice is kept
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO


def test_our_plugins_and_callbacks_are_wired():
    trainer = Trainer(accelerator="cpu", logger=False, checkpoint_every_n_steps=5, auto_fp32_fallback=True,
                      channels_last=True, compile=True, precision="bf16-master")
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    kinds = {type(c) for c in trainer.callbacks}
    assert {ResumeState, AutoFp32Fallback, ChannelsLast, CompileModel} <= kinds
    ckpt = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c._every_n_train_steps == 5]
    assert len(ckpt) == 1 and ckpt[0].save_last is True


@pytest.mark.parametrize("kwargs, steps", [
    (dict(max_epochs=1, limit_train_batches=0.5), 4),
    (dict(max_epochs=3, fast_dev_run=True), 1),
    (dict(max_epochs=50, callbacks=[EarlyStopping("val_loss", patience=0, min_delta=10.0)]), 16),
])
def test_lightning_arguments_pass_through(kwargs, steps):
    ds = classification_data(n=64)
    trainer = quiet_trainer(**kwargs)
    trainer.fit(Classifier(mlp()), _loader(ds, 8), _loader(ds, 32, shuffle=False))
    assert trainer.global_step == steps


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_validate_test_predict_after_fit(precision):
    ds = classification_data(n=64)
    model = Classifier(mlp())
    trainer = quiet_trainer(precision=precision, max_steps=3)
    trainer.fit(model, _loader(ds, 16))
    assert set(trainer.validate(model, _loader(ds, 32, shuffle=False), verbose=False)[0]) == {"val_loss", "val_acc"}
    assert set(trainer.test(model, _loader(ds, 32, shuffle=False), verbose=False)[0]) == {"test_loss"}
    preds = trainer.predict(model, torch.utils.data.DataLoader(ds.tensors[0], batch_size=32))
    assert len(preds) == 2 and preds[0].shape == (32, 4)


def test_load_from_checkpoint_reads_our_checkpoints(tmp_path):
    model = Classifier(mlp())
    trainer = quiet_trainer(precision="bf16-master", max_steps=3, default_root_dir=str(tmp_path))
    trainer.fit(model, _loader(classification_data(n=64), 16))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = Classifier.load_from_checkpoint(tmp_path / "m.ckpt", net=mlp())
    saved = torch.load(tmp_path / "m.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == loaded.state_dict().keys()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, saved[name]) and t.dtype == torch.float32, name
    # the fp32 masters, not the bf16 weights rounded back up
    assert not torch.equal(saved["net.0.weight"], saved["net.0.weight"].bfloat16().float())


def test_seed_makes_fit_repeatable():
    runs = []
    for draws in (1, 5):
        torch.manual_seed(0)
        model = Classifier(mlp(dropout=0.5))
        torch.rand(draws)  # the global RNG differs before fit; seed= makes dropout the same again
        trainer = quiet_trainer(seed=7, max_steps=3)
        trainer.fit(model, _loader(classification_data(n=64), 8))
        runs.append(torch.stack(model.losses))
    assert torch.equal(*runs)


class _Wrapped(Classifier):
    """Keeps its network as ``self.model``, the attribute ``compile=True`` compiles."""

    def __init__(self, net):
        super().__init__(net)
        self.model = self.net
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x)
        return self.model(x)


def test_compile_compiles_the_model_attribute_in_place():
    model = _Wrapped(mlp())
    keys = list(model.state_dict())
    trainer = quiet_trainer(compile={"backend": "eager"}, max_steps=2)
    trainer.fit(model, _loader(classification_data(n=32), 8))
    assert model.model._compiled_call_impl is not None and trainer.global_step == 2
    assert list(model.state_dict()) == keys  # checkpoints keep the eager run's keys (no `_orig_mod.`)


def test_compile_without_a_model_attribute_is_a_clear_error():
    with pytest.raises(ValueError, match="Classifier.model is missing"):
        quiet_trainer(compile=True, max_steps=1).fit(Classifier(mlp()), _loader(classification_data(n=16), 8))


def test_channels_last_converts_module_and_4d_inputs():
    model = _Wrapped(cnn())
    trainer = quiet_trainer(channels_last=True, max_steps=2)
    trainer.fit(model, _loader(image_data(n=32), 8))
    assert model.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x in model.inputs)


@pytest.mark.parametrize("limits", [dict(max_epochs=-1, max_steps=5), dict(max_epochs=3)])
def test_an_empty_train_loader_trains_zero_steps_as_in_lightning(limits):
    loader = torch.utils.data.DataLoader(classification_data(n=4), batch_size=8, drop_last=True)
    trainer = quiet_trainer(**limits)
    trainer.fit(Classifier(mlp()), loader)
    assert trainer.global_step == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_graphs_is_wired_and_refused_at_setup_without_cuda():
    from mptrain.callbacks.cuda_graphs import CudaGraphs

    trainer = quiet_trainer(precision="bf16-master", cuda_graphs=True, max_steps=1)
    assert sum(isinstance(c, CudaGraphs) for c in trainer.callbacks) == 1
    model = Classifier(mlp())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="cuda_graphs=True.*cuda_graphs=False"):
        trainer.fit(model, _loader(classification_data(n=16), 8))
    assert all(torch.equal(a, b.float()) for a, b in zip(before, model.parameters()))


class _FSDPOnCpu(FSDPStrategy):
    """Lightning refuses the FSDPStrategy class itself with accelerator='cpu'; a subclass constructs."""


def test_fsdp_strategy_gets_the_sharded_plugin():
    from mptrain import ShardedPrecision

    trainer = quiet_trainer(precision="bf16-master", strategy=_FSDPOnCpu(), loss_scaler={"init_scale": 8.0})
    assert isinstance(trainer.precision_plugin, ShardedPrecision)
    assert trainer.precision_plugin.precision == "bf16-master" and trainer.loss_scaler.scale == 8.0


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "bf16-true"}, "precision='bf16-true' cannot run with strategy='fsdp'.*Valid values: 32-true, "
                                 "16-mixed, bf16-mixed, 16-master, bf16-master"),
    ({"precision": "bf16-master", "fp32_finetune_epochs": 1, "max_epochs": 2}, "fp32_finetune_epochs=1 cannot run"),
    ({"precision": "bf16-master", "auto_fp32_fallback": True}, "auto_fp32_fallback=True cannot run"),
    ({"precision": "bf16-master", "cuda_graphs": True}, "cuda_graphs=True cannot run"),
    ({"plugins": [MasterPrecision("bf16-master")]}, r"needs mptrain.ShardedPrecision\('bf16-master'\)"),
])
def test_what_sharding_cannot_run_is_refused_when_the_trainer_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quiet_trainer(strategy="fsdp", **kwargs)


def test_master_modes_are_refused_with_the_model_parallel_strategy():
    with pytest.raises(ValueError, match="precision='bf16-master' cannot run with strategy='model_parallel'.*"
                                         "Use strategy='fsdp'"):
        quiet_trainer(strategy="model_parallel", precision="bf16-master")


def test_sharding_refusals_also_apply_with_a_users_sharded_plugin():
    from mptrain import ShardedPrecision

    with pytest.raises(ValueError, match="fp32_finetune_steps=1 cannot run with strategy='fsdp'"):
        quiet_trainer(strategy="fsdp", plugins=[ShardedPrecision("bf16-master")], fp32_finetune_steps=1, max_steps=2)
