"""ShardedPrecision without processes: its modes, what it asks FSDP for, and what it refuses."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import mlp
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy

from mptrain import ShardedPrecision
from mptrain.precision import precision_plugin


@pytest.mark.parametrize("mode", ["16-true", "bf16-true", "64-true"])
def test_modes_sharding_cannot_run_are_refused_naming_the_valid_ones(mode):
    with pytest.raises(ValueError, match="Valid values: '32-true', '16-mixed', 'bf16-mixed', '16-master', "
                                         "'bf16-master'"):
        ShardedPrecision(mode)


def test_it_is_a_lightning_fsdp_precision_that_both_fsdp_strategies_accept():
    plugin = precision_plugin("bf16-master", sharded=True)
    assert isinstance(plugin, ShardedPrecision) and isinstance(plugin, FSDPPrecision)
    strategy = FSDPStrategy()
    strategy.precision_plugin = plugin  # Lightning's setter raises TypeError for any other plugin
    assert strategy.precision_plugin is plugin and plugin.scaler is None
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy

    fabric_strategy = FabricFSDPStrategy()
    fabric_strategy.precision = plugin  # Fabric's own FSDPPrecision check
    assert fabric_strategy.precision is plugin


@pytest.mark.parametrize("mode, param, scaler", [("bf16-master", torch.bfloat16, False),
                                                 ("16-master", torch.float16, True),
                                                 ("bf16-mixed", torch.bfloat16, False),
                                                 ("16-mixed", torch.float16, True)])
def test_half_modes_all_gather_half_and_reduce_fp32_with_norms_left_fp32(mode, param, scaler):
    plugin = ShardedPrecision(mode)
    module = plugin.convert_module(mlp())
    assert {p.dtype for p in module.parameters()} == {torch.float32}, "the params to shard are the fp32 masters"
    mp = plugin.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (param, torch.float32, param)
    assert tuple(mp._module_classes_to_ignore) == (torch.nn.LayerNorm,)
    assert (plugin.loss_scaler is not None) == scaler
    assert plugin.has_master_weights == mode.endswith("-master")
    assert plugin.autocast_dtype == (param if mode.endswith("-mixed") else None)


def test_32_true_asks_fsdp_for_no_mixed_precision_and_norms_fp32_can_be_off():
    assert ShardedPrecision("32-true").mixed_precision_config is None
    plugin = ShardedPrecision("bf16-master", norms_fp32=False)
    plugin.convert_module(mlp())
    assert tuple(plugin.mixed_precision_config._module_classes_to_ignore) == ()
    with pytest.raises(ValueError, match="norms_fp32='yes' is not valid; valid values: True, False"):
        ShardedPrecision("bf16-master", norms_fp32="yes")


def test_an_unsharded_model_is_refused_at_setup():
    plugin = ShardedPrecision("bf16-master")
    with pytest.raises(ValueError, match="runs under strategy='fsdp'.*mptrain.MasterPrecision"):
        plugin.connect(mlp(), [], [])


def test_module_promotion_and_the_switch_to_fp32_are_refused():
    plugin = ShardedPrecision("bf16-master")
    with pytest.raises(ValueError, match="auto_fp32_fallback cannot run"):
        plugin.enable_auto_fallback(mlp())
    with pytest.raises(ValueError, match="FSDP fixes its mixed precision when it wraps"):
        plugin.switch_to_fp32(mlp(), [])


def test_init_context_creates_fp32_modules():
    with ShardedPrecision("bf16-master").module_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_plain_lightning_refuses_a_sharded_plugin_without_fsdp_at_setup():
    from _models import Classifier, classification_data

    trainer = L.Trainer(plugins=[ShardedPrecision("bf16-master")], accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(classification_data(n=16), batch_size=8)
    with pytest.raises(ValueError, match="runs under strategy='fsdp'"):
        trainer.fit(Classifier(mlp()), loader)


def test_a_strategys_own_mixed_precision_is_refused_at_setup():
    from types import SimpleNamespace

    from torch.distributed.fsdp import MixedPrecision

    plugin = ShardedPrecision("bf16-master")
    plugin.convert_module(mlp())
    wrapped = SimpleNamespace(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="reduce_dtype=torch.float32. Drop FSDPStrategy\\(mixed_precision=...\\)"):
        plugin._check_wrapped_precision(wrapped)
    plugin._check_wrapped_precision(SimpleNamespace(mixed_precision=plugin.mixed_precision_config))


def test_fp32_finetune_and_auto_fallback_callbacks_are_refused_at_setup():
    from types import SimpleNamespace

    from mptrain import AutoFp32Fallback, Fp32Finetune

    plugin = ShardedPrecision("bf16-master")
    for callback, message in ((Fp32Finetune(steps=1), "Fp32Finetune cannot run"),
                              (AutoFp32Fallback(), "AutoFp32Fallback cannot run")):
        module = SimpleNamespace(_trainer=SimpleNamespace(callbacks=[callback]))
        with pytest.raises(ValueError, match=message):
            plugin._check_callbacks(module)


def test_a_checkpoint_with_non_finite_weights_is_written_with_a_warning():
    plugin = ShardedPrecision("bf16-master")
    plugin.on_save_checkpoint({"state_dict": {"w": torch.ones(3), "step": torch.tensor(2)}})
    with pytest.warns(UserWarning, match="saving a checkpoint with a weight holding inf/NaN"):
        plugin.on_save_checkpoint({"state_dict": {"w": torch.tensor([1.0, float("nan")])}})


def test_norms_fp32_without_an_auto_wrap_policy_is_a_warning():
    plugin = ShardedPrecision("bf16-master")
    model = plugin.convert_module(mlp())  # no FSDP unit of its own for the LayerNorm
    with pytest.warns(UserWarning, match=r"norm layers \(LayerNorm\) run with half weights.*auto_wrap_policy"):
        plugin._warn_if_norms_half(model)
