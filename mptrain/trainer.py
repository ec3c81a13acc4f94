"""mptrain's Trainer: ``lightning.pytorch.Trainer`` with mptrain's arguments (DESIGN §3) turned into a
precision plugin, a checkpoint IO plugin and callbacks, and a train loader resumable mid-epoch."""
from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision

from mptrain.callbacks.auto_fp32_fallback import AutoFp32Fallback
from mptrain.callbacks.channels_last import ChannelsLast
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.cuda_graphs import CudaGraphs
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.callbacks.fuse_modules import FuseModules
from mptrain.callbacks.resume_state import ResumeState
from mptrain.compat.lightning import is_unset_wrapping_io
from mptrain.resume import AtomicCheckpointIO, attach, resolve_ckpt_path
from mptrain.precision import normalize_precision, precision_plugin
from mptrain.precision.sharded import is_sharded_strategy
from mptrain.trainer_checks import (check_arguments, check_finetune, check_fuse_modules, check_mode_for_strategy,
                                    check_lightning_precision, check_sharded_arguments, check_sharded_plugin,
                                    check_user_plugin, is_lightning_precision)


_FIT_CKPT_PATH = list(inspect.signature(pl.Trainer.fit).parameters).index("ckpt_path") - 1  # after self


class Trainer(pl.Trainer):
    """A ``lightning.pytorch.Trainer`` that trains in any mptrain precision mode; every Lightning argument works.

    Args:
        precision: One of ``mptrain.PRECISIONS`` or a Lightning alias (``32``, ``16``, ``bf16``); default
            ``32-true``; leave it unset when ``plugins`` holds a precision plugin.  Lightning's modes that mptrain
            does not run (``64-true``, ``transformer-engine*``) get Lightning's own plugin, untouched.
        fp32_finetune_epochs: Train the last N epochs of a ``max_epochs`` run in ``32-true`` (optimizer state kept).
        fp32_finetune_steps: Train the last N optimizer steps of a ``max_steps`` run in ``32-true``.
        loss_scaler: None for the mode's default, a ``DynamicLossScaler``, or a dict of its arguments.
        fp32_fallback: Ops computed in fp32 whatever the mode: ``"default"``, a list of op names
            (``"+name"``/``"-name"`` edit the default list) or ``[]``.
        auto_fp32_fallback: Promote modules whose output overflows to fp32, and log which.
        fused: ``"auto"``: the fused CUDA kernels where available, ``True``: required, ``False``: PyTorch only.
        fuse_modules: Swap mptrain's fused modules into the LightningModule at setup (any attribute; Parameter
            objects and state-dict keys kept; one log line lists them), each only where measured faster:
            LayerNorm / RMSNorm (eager only: ``torch.compile`` keeps its own), MaxPool2d and ragged vocabulary
            ``nn.Linear`` layers.  ``"auto"``: on for a CUDA run in a 16-bit mode with ``fused`` not False;
            ``True``: on in every mode and device; ``False``: off.  See :class:`~mptrain.callbacks.FuseModules`.
        cuda_graphs: Capture the train step in CUDA graphs and replay it (one GPU, no accumulation): the one call
            per step of ``self(...)`` or of a direct submodule (``self.model(...)``) and its backward, and the
            optimizer step.
        checkpoint_every_n_steps: Add ``ModelCheckpoint(every_n_train_steps=N, save_last=True)``.
        channels_last: Convert the module and every 4-D input batch to ``torch.channels_last``.
        seed: ``seed_everything(seed, workers=True)`` at the start of ``fit``.
        compile: ``True`` or a dict of ``torch.compile`` arguments: compile the LightningModule's ``model``.
        sdpa: The ``scaled_dot_product_attention`` back end every forward prefers: ``"auto"`` (mptrain's measured
            order for the GPU, :mod:`mptrain.precision.sdpa_backend`), ``"torch"`` (torch's own order) or a list
            of ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"`` in priority order.

    With ``strategy="fsdp"`` the plugin is a :class:`~mptrain.precision.sharded.ShardedPrecision`
    (``*-true`` half modes, ``fp32_finetune_*``, ``auto_fp32_fallback`` and ``cuda_graphs`` are refused).
    """

    def __init__(self, *, precision: Optional[Union[str, int]] = None, fp32_finetune_epochs: int = 0,
                 fp32_finetune_steps: int = 0, loss_scaler: Any = None,
                 fp32_fallback: Union[str, list[str]] = "default", auto_fp32_fallback: bool = False,
                 fused: Union[str, bool] = "auto", fuse_modules: Union[str, bool] = "auto", cuda_graphs: bool = False,
                 checkpoint_every_n_steps: Optional[int] = None, channels_last: bool = False,
                 seed: Optional[int] = None, compile: Union[bool, dict[str, Any]] = False, sdpa: Any = "auto",
                 plugins: Any = None, callbacks: Any = None, **kwargs: Any) -> None:
        check_finetune(fp32_finetune_epochs, fp32_finetune_steps, kwargs)
        check_arguments(cuda_graphs, checkpoint_every_n_steps, channels_last, seed, compile, auto_fp32_fallback)
        check_fuse_modules(fuse_modules, fused)
        plugins = _as_list(plugins)
        strategy = kwargs.get("strategy")
        sharded = is_sharded_strategy(strategy)
        if sharded:
            check_sharded_arguments(strategy, fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback,
                                     cuda_graphs)
        user_plugin = next((p for p in plugins if isinstance(p, Precision)), None)
        if user_plugin is not None:
            check_user_plugin(precision, loss_scaler, fp32_fallback, fused, sdpa)
            check_sharded_plugin(strategy, sharded, user_plugin)
        elif is_lightning_precision(precision):  # a mode mptrain does not run (64-true, transformer-engine)
            check_lightning_precision(precision, loss_scaler, fp32_fallback, fused, sdpa)
            kwargs["precision"] = precision  # Lightning picks its own plugin, as lightning.Trainer does
        else:
            name = normalize_precision("32-true" if precision is None else precision)
            check_mode_for_strategy(strategy, sharded, name)
            plugins.append(precision_plugin(name, sharded=sharded, loss_scaler=loss_scaler,
                                            fp32_fallback=fp32_fallback, fused=fused, sdpa=sdpa))
        io = next((p for p in plugins if isinstance(p, CheckpointIO)), None)
        if io is None:
            plugins.append(AtomicCheckpointIO())
        elif is_unset_wrapping_io(io):  # e.g. AsyncCheckpointIO()
            io.checkpoint_io = AtomicCheckpointIO()
        # ours first (a user's epoch-start hook sees the new phase); ResumeState last: it restores the RNG
        # after every other on_train_start hook, the moment the uninterrupted run was at
        ours = _our_callbacks(fp32_finetune_epochs, fp32_finetune_steps, auto_fp32_fallback, checkpoint_every_n_steps,
                              channels_last, compile, cuda_graphs, fuse_modules)
        callbacks = ours + _as_list(callbacks) + [ResumeState()]
        self._mptrain_seed = seed
        super().__init__(plugins=plugins, callbacks=callbacks, **kwargs)
        attach(self)

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``fit``; ``ckpt_path="last"`` resumes the newest "last" checkpoint of this run's root, across
        the logger's versions; where there is none, Lightning warns and starts a new run."""
        args = list(args)
        if len(args) > _FIT_CKPT_PATH:
            args[_FIT_CKPT_PATH] = resolve_ckpt_path(self, args[_FIT_CKPT_PATH])
        elif "ckpt_path" in kwargs:
            kwargs["ckpt_path"] = resolve_ckpt_path(self, kwargs["ckpt_path"])
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
                   channels_last, compile, cuda_graphs, fuse_modules="auto") -> list:
    table = [  # (wanted, callback class, its arguments), in the order they run
        # first: its setup swaps modules before CompileModel's compiles them and the optimizers are built
        (fuse_modules is not False, FuseModules, dict(mode=fuse_modules)),
        (fp32_finetune_epochs or fp32_finetune_steps, Fp32Finetune,
         dict(epochs=fp32_finetune_epochs, steps=fp32_finetune_steps)),
        (auto_fp32_fallback, AutoFp32Fallback, {}),
        (checkpoint_every_n_steps is not None, ModelCheckpoint,
         dict(every_n_train_steps=checkpoint_every_n_steps, save_last=True)),
        (channels_last, ChannelsLast, {}),
        (compile, CompileModel, compile if isinstance(compile, dict) else {}),
        (cuda_graphs, CudaGraphs, {}),
    ]
    return [cls(**kwargs) for wanted, cls, kwargs in table if wanted]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
