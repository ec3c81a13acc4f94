"""mptrain's Trainer: ``lightning.pytorch.Trainer`` with the precision engine plugged in.

The loop, callbacks, loggers and checkpoint layout are Lightning's.  This class only turns
mptrain's arguments (DESIGN §3) into a precision plugin, a checkpoint IO plugin and
callbacks, and makes the train loader resumable mid-epoch.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision

from mptrain.callbacks.auto_fp32_fallback import AutoFp32Fallback
from mptrain.callbacks.channels_last import ChannelsLast
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.cuda_graphs import CudaGraphs
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.callbacks.resumable_loader import make_train_loader_resumable
from mptrain.callbacks.resume_state import ResumeState
from mptrain.checkpoint import AtomicCheckpointIO
from mptrain.precision import MptrainPrecision, normalize_precision, precision_plugin
from mptrain.precision.sharded import ShardedPrecision, is_sharded_strategy


class Trainer(pl.Trainer):
    """A ``lightning.pytorch.Trainer`` that trains in any mptrain precision mode.

    Every ``lightning.pytorch.Trainer`` argument is accepted unchanged (``**kwargs``).

    Args:
        precision: One of ``mptrain.PRECISIONS`` (``32-true``, ``16-mixed``, ``bf16-mixed``,
            ``16-true``, ``bf16-true``, ``16-master``, ``bf16-master``) or a Lightning alias
            (``32``, ``16``, ``bf16``). Default ``32-true``; leave it unset when ``plugins``
            holds a precision plugin.
        fp32_finetune_epochs: Train the last N epochs in ``32-true`` (fp32 weights from the
            masters, optimizer state kept). Needs an epoch-based run (``max_epochs`` > 0).
        fp32_finetune_steps: Train the last N optimizer steps of a ``max_steps`` run in ``32-true``.
        loss_scaler: None for the mode's default, a ``DynamicLossScaler``, or a dict of its
            arguments.
        fp32_fallback: ``"default"``, a list of op names (``"+name"``/``"-name"`` edit the
            default list) or ``[]``: ops computed in fp32 whatever the mode.
        auto_fp32_fallback: Promote modules whose output overflows to fp32, and log which.
        fused: ``"auto"`` uses the fused CUDA kernels where available, ``True`` requires them,
            ``False`` uses the PyTorch references only.
        cuda_graphs: Capture the train step in CUDA graphs and replay it (the ``CudaGraphs``
            callback; one CUDA GPU, no accumulation; what it cannot capture is refused at setup).
        checkpoint_every_n_steps: Add ``ModelCheckpoint(every_n_train_steps=N, save_last=True)``.
        channels_last: Convert the module and every 4-D input batch to ``torch.channels_last``.
        seed: ``seed_everything(seed, workers=True)`` at the start of ``fit``.
        compile: ``True`` or a dict of ``torch.compile`` arguments: compile the
            LightningModule's ``model`` attribute at setup.

    With ``strategy="fsdp"`` (or an ``FSDPStrategy``) the precision plugin is a
    :class:`~mptrain.precision.sharded.ShardedPrecision`: the sharded fp32 parameters are the
    masters. ``*-true`` half modes, ``fp32_finetune_*``, ``auto_fp32_fallback`` and
    ``cuda_graphs`` are refused there.
    """

    def __init__(
        self,
        *,
        precision: Optional[Union[str, int]] = None,
        fp32_finetune_epochs: int = 0,
        fp32_finetune_steps: int = 0,
        loss_scaler: Any = None,
        fp32_fallback: Union[str, list[str]] = "default",
        auto_fp32_fallback: bool = False,
        fused: Union[str, bool] = "auto",
        cuda_graphs: bool = False,
        checkpoint_every_n_steps: Optional[int] = None,
        channels_last: bool = False,
        seed: Optional[int] = None,
        compile: Union[bool, dict[str, Any]] = False,
        plugins: Any = None,
        callbacks: Any = None,
        **kwargs: Any,
    ) -> None:
        _check_finetune(fp32_finetune_epochs, fp32_finetune_steps, kwargs)
        _check_arguments(cuda_graphs, checkpoint_every_n_steps, channels_last, seed, compile, auto_fp32_fallback)
        plugins = _as_list(plugins)
        strategy = kwargs.get("strategy")
        sharded = is_sharded_strategy(strategy)
        if sharded:
            _check_sharded_arguments(strategy, fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback,
                                     cuda_graphs)
        if any(isinstance(p, Precision) for p in plugins):
            _check_user_plugin(precision, loss_scaler, fp32_fallback, fused)
            _check_sharded_plugin(strategy, plugins)
        else:
            name = normalize_precision("32-true" if precision is None else precision)
            _check_mode_for_strategy(strategy, name)
            plugins.append(precision_plugin(name, sharded=sharded, loss_scaler=loss_scaler,
                                            fp32_fallback=fp32_fallback, fused=fused))
        io = next((p for p in plugins if isinstance(p, CheckpointIO)), None)
        if io is None:
            plugins.append(AtomicCheckpointIO())
        elif isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None:  # e.g. AsyncCheckpointIO()
            io.checkpoint_io = AtomicCheckpointIO()
        # ours first (a user's epoch-start hook sees the new phase); ResumeState last: it restores the RNG
        # after every other on_train_start hook, the moment the uninterrupted run was at
        ours = _our_callbacks(fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback, checkpoint_every_n_steps,
                              channels_last, compile, cuda_graphs)
        callbacks = ours + _as_list(callbacks) + [ResumeState()]
        self._mptrain_seed = seed
        super().__init__(plugins=plugins, callbacks=callbacks, **kwargs)
        make_train_loader_resumable(self)

    def fit(self, *args: Any, **kwargs: Any) -> None:
        if self._mptrain_seed is not None:
            seed_everything(self._mptrain_seed, workers=True)
        return super().fit(*args, **kwargs)

    @property
    def loss_scaler(self):
        """The precision plugin's ``DynamicLossScaler``, or None when the mode has none."""
        return getattr(self.precision_plugin, "loss_scaler", None)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of non-finite gradients."""
        return int(getattr(self.precision_plugin, "skipped_steps", 0))


def _our_callbacks(fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback, checkpoint_every_n_steps,
                   channels_last, compile, cuda_graphs) -> list:
    callbacks: list = []
    if fp32_finetune_epochs or fp32_finetune_steps:
        callbacks.append(Fp32Finetune(epochs=fp32_finetune_epochs, steps=fp32_finetune_steps))
    if auto_fp32_fallback:
        callbacks.append(AutoFp32Fallback())
    if checkpoint_every_n_steps is not None:
        callbacks.append(ModelCheckpoint(every_n_train_steps=checkpoint_every_n_steps, save_last=True))
    if channels_last:
        callbacks.append(ChannelsLast())
    if compile:
        callbacks.append(CompileModel(**({} if compile is True else compile)))
    if cuda_graphs:
        callbacks.append(CudaGraphs())
    return callbacks


def _check_arguments(cuda_graphs, checkpoint_every_n_steps, channels_last, seed, compile, auto_fp32_fallback) -> None:
    if checkpoint_every_n_steps is not None:
        _check_int("checkpoint_every_n_steps", checkpoint_every_n_steps, minimum=1)
    if seed is not None:
        _check_int("seed", seed, minimum=0)
    for name, value in (("cuda_graphs", cuda_graphs), ("channels_last", channels_last),
                        ("auto_fp32_fallback", auto_fp32_fallback)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not valid; valid values: True, False")
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"compile={compile!r} is not valid; valid values: True, False, or a dict of torch.compile arguments")


def _check_finetune(epochs, steps, lightning_kwargs) -> None:
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


def _check_sharded_arguments(strategy, fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback,
                             cuda_graphs) -> None:
    """What a sharded strategy cannot run is refused here, before any process starts."""
    refused = {"fp32_finetune_epochs": fp32_finetune_epochs, "fp32_finetune_steps": fp32_finetune_steps,
               "auto_fp32_fallback": auto_fp32_fallback, "cuda_graphs": cuda_graphs}
    given = [f"{k}={v!r}" for k, v in refused.items() if v]
    if given:
        raise ValueError(f"{', '.join(given)} cannot run with strategy={_name(strategy)!r}: FSDP fixes parameter "
                         f"dtypes when it wraps the model and replays no graph. Drop them, or train with "
                         f"strategy='ddp'")


def _check_mode_for_strategy(strategy, name: str) -> None:
    """The sharded strategies run only some modes: refused by name, with the valid ones."""
    if is_sharded_strategy(strategy):
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


def _check_sharded_plugin(strategy, plugins) -> None:
    plugin = next(p for p in plugins if isinstance(p, Precision))
    if is_sharded_strategy(strategy) and not isinstance(plugin, ShardedPrecision) \
            and isinstance(plugin, MptrainPrecision):
        raise ValueError(f"strategy={_name(strategy)!r} needs mptrain.ShardedPrecision({plugin.precision!r}) "
                         f"(a Lightning FSDPPrecision), not {plugin!r}")


def _name(strategy) -> str:
    return strategy if isinstance(strategy, str) else type(strategy).__name__


def _check_user_plugin(precision, loss_scaler, fp32_fallback, fused) -> None:
    given = {k: v for k, v, default in (("precision", precision, None), ("loss_scaler", loss_scaler, None),
                                       ("fp32_fallback", fp32_fallback, "default"), ("fused", fused, "auto"))
             if v != default}
    if given:
        raise ValueError(
            f"plugins= holds a precision plugin, so {', '.join(f'{k}={v!r}' for k, v in given.items())} would be "
            f"ignored: configure the plugin itself, or drop it from plugins and pass these arguments"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid; valid values: an integer >= {minimum}")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
