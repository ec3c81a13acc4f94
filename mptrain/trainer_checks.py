"""The checks of ``mptrain.Trainer``'s arguments: each refusal names the argument, its value and the fix,
before anything is created (no process group, no model setup)."""
from __future__ import annotations

from typing import Any

from mptrain.callbacks.fuse_modules import check_fuse_mode
from mptrain.precision import MptrainPrecision
from mptrain.precision.sharded import ShardedPrecision


def check_arguments(cuda_graphs, checkpoint_every_n_steps, channels_last, seed, compile, auto_fp32_fallback) -> None:
    if checkpoint_every_n_steps is not None:
        _check_int("checkpoint_every_n_steps", checkpoint_every_n_steps, minimum=1)
    if seed is not None:
        _check_int("seed", seed, minimum=0)
    for name, value in (("cuda_graphs", cuda_graphs), ("channels_last", channels_last),
                        ("auto_fp32_fallback", auto_fp32_fallback)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not valid; valid values: True, False")
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"compile={compile!r} is not valid; valid values: True, False, "
                         "or a dict of torch.compile arguments")


def check_fuse_modules(fuse_modules, fused) -> None:
    """``fuse_modules`` is "auto", True or False, and True needs mptrain's kernels (``fused`` not False)."""
    check_fuse_mode(fuse_modules)
    if fuse_modules is True and fused is False:
        raise ValueError("fuse_modules=True swaps in mptrain's fused modules, but fused=False runs PyTorch only: "
                         "drop one of them (fuse_modules='auto' is off with fused=False)")


def check_finetune(epochs, steps, lightning_kwargs) -> None:
    """Each fine-tune length must mean something in this run: refused here, before any setup."""
    _check_int("fp32_finetune_epochs", epochs, minimum=0)
    _check_int("fp32_finetune_steps", steps, minimum=0)
    max_epochs, max_steps = lightning_kwargs.get("max_epochs"), lightning_kwargs.get("max_steps", -1)
    if epochs and steps:
        raise ValueError(f"fp32_finetune_epochs={epochs} and fp32_finetune_steps={steps}: give one of them")
    if epochs and max_epochs in (None, -1) and max_steps != -1:
        raise ValueError(f"fp32_finetune_epochs={epochs} needs an epoch-based run, but max_epochs={max_epochs!r} and "
                         f"max_steps={max_steps}: set max_epochs, or use fp32_finetune_steps")
    if epochs and max_epochs is not None and epochs > max_epochs >= 0:
        raise ValueError(f"fp32_finetune_epochs={epochs} is more than max_epochs={max_epochs}")
    if steps and not steps <= max_steps:
        raise ValueError(f"fp32_finetune_steps={steps} needs max_steps >= {steps} (got max_steps={max_steps})")


def check_sharded_arguments(strategy, fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback,
                             cuda_graphs) -> None:
    """What a sharded strategy cannot run is refused here, before any process starts."""
    refused = {"fp32_finetune_epochs": fp32_finetune_epochs, "fp32_finetune_steps": fp32_finetune_steps,
               "auto_fp32_fallback": auto_fp32_fallback, "cuda_graphs": cuda_graphs}
    given = [f"{k}={v!r}" for k, v in refused.items() if v]
    if given:
        raise ValueError(f"{', '.join(given)} cannot run with strategy={_name(strategy)!r}: FSDP fixes parameter "
                         f"dtypes when it wraps the model and replays no graph. Drop them, or train with "
                         f"strategy='ddp'")


def check_mode_for_strategy(strategy, sharded: bool, name: str) -> None:
    """The sharded strategies run only some modes: refused by name, with the valid ones."""
    if sharded:
        if name not in ShardedPrecision.MODES:
            raise ValueError(f"precision={name!r} cannot run with strategy={_name(strategy)!r}: the sharded fp32 "
                             f"parameters are the masters. Valid values: {', '.join(ShardedPrecision.MODES)}")
        return
    from lightning.pytorch.strategies import ModelParallelStrategy

    parallel = strategy == "model_parallel" or isinstance(strategy, ModelParallelStrategy)
    if parallel and name.endswith("-master"):
        raise ValueError(f"precision={name!r} cannot run with strategy={_name(strategy)!r} (the module is sharded in "
                         f"configure_model before the half copy is made). Use strategy='fsdp' with {name!r}, or "
                         f"one of Lightning's precisions for ModelParallelStrategy")


def check_sharded_plugin(strategy, sharded: bool, plugin) -> None:
    """A sharded strategy with one of mptrain's unsharded plugins: refused, naming the one to use."""
    if sharded and isinstance(plugin, MptrainPrecision) and not isinstance(plugin, ShardedPrecision):
        raise ValueError(f"strategy={_name(strategy)!r} needs mptrain.ShardedPrecision({plugin.precision!r}) "
                         f"(a Lightning FSDPPrecision), not {plugin!r}")


def _name(strategy) -> str:
    return strategy if isinstance(strategy, str) else type(strategy).__name__


def _given(precision, loss_scaler, fp32_fallback, fused, sdpa) -> list[str]:
    """``name=value`` of the plugin-building arguments set away from their defaults (``precision=None`` left
    out by passing it as None)."""
    return [f"{k}={v!r}" for k, v, default in (("precision", precision, None), ("loss_scaler", loss_scaler, None),
                                               ("fp32_fallback", fp32_fallback, "default"), ("fused", fused, "auto"),
                                               ("sdpa", sdpa, "auto"))
            if v != default]


def check_user_plugin(precision, loss_scaler, fp32_fallback, fused, sdpa="auto") -> None:
    given = _given(precision, loss_scaler, fp32_fallback, fused, sdpa)
    if given:
        raise ValueError(f"plugins= holds a precision plugin, so {', '.join(given)} would be ignored: configure the "
                         f"plugin itself, or drop it from plugins and pass these arguments")


def is_lightning_precision(precision) -> bool:
    """A precision value Lightning accepts and mptrain does not run (``64-true``, ``transformer-engine``, ...): it goes
    to Lightning's own plugin."""
    from mptrain.compat.lightning import precision_inputs
    from mptrain.precision import normalize_precision

    if precision is None or precision not in precision_inputs():
        return False
    try:
        normalize_precision(precision)
    except ValueError:
        return True
    return False


def check_lightning_precision(precision, loss_scaler, fp32_fallback, fused, sdpa="auto") -> None:
    given = _given(None, loss_scaler, fp32_fallback, fused, sdpa)  # the precision itself is Lightning's to run
    if given:
        raise ValueError(f"precision={precision!r} is Lightning's own mode, run by Lightning's plugin, so "
                         f"{', '.join(given)} would be ignored: drop them, or pick one of mptrain's modes")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid; valid values: an integer >= {minimum}")
