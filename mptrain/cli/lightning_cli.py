"""``mptrain fit|validate|test|predict``: Lightning's ``LightningCLI`` with mptrain's Trainer, unchanged
but for config mistakes and refusals, which become one line and exit 2 and leave nothing behind: after
parsing (no abbreviated flags), every ``class_path`` is checked against the kind its key expects, Trainer
values Lightning would only reject later are checked, ``--ckpt_path`` must exist and be an intact
checkpoint, and a constructor's ``ValueError`` / ``TypeError`` / ``MisconfigurationException`` becomes a
``ConfigError``; an error of the run's setup that is a refusal (:func:`mptrain.cli.errors.refusal`)
becomes one too, after the files the run had created are removed.  ``config.yaml`` goes into the run's
own folder (:func:`mptrain.cli.run_dir.run_folder`), and the last line of stdout is a JSON summary.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI

from mptrain.cli.class_paths import check_class_paths
from mptrain.cli.errors import CONSTRUCTION_ERRORS, ConfigError, explain_parse_error, innermost_error, one_line, \
    parser_keys, refusal
from mptrain.cli.run_dir import RunConfigCallback, RunFiles, keep_wandb_files_in_the_run, place_run_under_root, \
    run_folder, run_own_paths, run_roots
from mptrain.cli.tools import TOOLS, tool_parser
from mptrain.cli.trainer_values import check_ckpt_path, check_trainer_values
from mptrain.cli.vocab import fill_vocab_size
from mptrain.compat.lightning import subcommand_parser


class MptrainCLI(LightningCLI):
    """LightningCLI with ``mptrain.Trainer``, any LightningModule / LightningDataModule
    (``class_path``), the models' own ``configure_optimizers``, and a per-run saved config."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        from mptrain import Trainer

        # config.yaml goes to the run's own folder (version_N, W&B's run id); overwrite only matters without a logger
        defaults = dict(trainer_class=Trainer, subclass_mode_model=True, subclass_mode_data=True,
                        auto_configure_optimizers=False, save_config_callback=RunConfigCallback,
                        save_config_kwargs={"overwrite": True})
        super().__init__(args=args, **{**defaults, **kwargs})

    def init_parser(self, **kwargs: Any):
        kwargs.setdefault("exit_on_error", False)  # main() turns the error into one line
        kwargs.setdefault("prog", "mptrain")
        kwargs.setdefault("allow_abbrev", False)  # --trainer.max_epoch is unknown, not max_epochs
        return super().init_parser(**kwargs)

    def _add_subcommands(self, parser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        for name, text in TOOLS.items():  # listed in `mptrain --help`; main() runs them
            parser._subcommands_action.add_subcommand(name, tool_parser(name), help=text)

    def parse_arguments(self, parser, args) -> None:
        """LightningCLI's parse (without its warning about args next to sys.argv: main() passes
        sys.argv's own arguments), every jsonargparse error turned into a ConfigError."""
        try:
            self.config = parser.parse_object(args) if isinstance(args, dict) else parser.parse_args(args)
        except ArgumentError as e:  # jsonargparse's, with exit_on_error=False
            # the chosen subcommand's keys, for the did-you-mean
            argv = (sys.argv[1:] if args is None else args) or []
            sub_parser = subcommand_parser(self, next((a for a in argv if a in self.subcommands()), None))
            keys = parser_keys(sub_parser) if sub_parser is not None else {"": list(self.subcommands())}
            raise ConfigError(explain_parse_error(str(e), keys)) from None

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's: the model's hyperparameters saved in ``--ckpt_path`` update the config.  The file is read
        with mptrain's checkpoint reader (verified, ``weights_only``): a damaged or unsafe checkpoint is refused
        here, before anything is created."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return
        from mptrain.resume import AtomicCheckpointIO, CheckpointError

        try:
            ckpt = AtomicCheckpointIO().load_checkpoint(ckpt_path, map_location="cpu")
        except CheckpointError as e:
            raise ConfigError(f"{subcommand} --ckpt_path={ckpt_path!r}: {one_line(e)}. {_OTHER_CHECKPOINT}") from e
        hparams = dict(ckpt.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except ArgumentError as e:
            raise ConfigError(f"{subcommand} --ckpt_path={ckpt_path!r}: the model hyperparameters it holds do not "
                              f"fit this config: {explain_parse_error(str(e))}") from None

    def _set_seed(self) -> None:
        """The config checks run first: a mistake is reported before anything else is printed."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        plain = config.clone().as_dict()
        trainer_class = self.trainer_class if isinstance(self.trainer_class, type) else object
        check_class_paths({k: plain.get(k) for k in ("trainer", "model", "data", "optimizer", "lr_scheduler")
                           if k in plain}, trainer_class)
        check_trainer_values(plain.get("trainer") or {})
        check_ckpt_path(plain.get("ckpt_path"), self.subcommand or "")
        super()._set_seed()

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's run, then one machine-readable line, the last of stdout: step, the run's folder, its metrics.
        A refusal while the run is set up (before any loop) removes what the run created and becomes a
        ConfigError; an error once a loop runs keeps its traceback."""
        from mptrain.resume import CheckpointError

        trainer = self.trainer
        started = _LoopStarted()
        trainer.callbacks.append(started)
        keep_wandb_files_in_the_run(trainer)
        files = RunFiles(run_roots(trainer)) if trainer.is_global_zero else None
        try:
            super()._run_subcommand(subcommand)
        except Exception as e:
            message = refusal(e, started.value)
            if message is None:
                raise
            _finish_wandb(trainer)
            if files is not None and not started.value:
                files.remove_new(*run_own_paths(trainer))
            where = f"during {subcommand} setup: " if not started.value and isinstance(e, CONSTRUCTION_ERRORS) else ""
            if isinstance(e, CheckpointError) and self.config_init[subcommand].get("ckpt_path"):
                message = f"{subcommand} --ckpt_path={self.config_init[subcommand]['ckpt_path']!r}: {message}. " \
                          f"{_OTHER_CHECKPOINT}"
            raise ConfigError(where + message) from e
        log_dir = run_folder(trainer)  # a broadcast under DDP: every rank asks
        if trainer.is_global_zero:
            _finish_wandb(trainer)  # its closing lines print now, before the summary
            metrics = {k: round(float(v), 6) for k, v in sorted(trainer.callback_metrics.items()) if v.numel() == 1}
            print(json.dumps({"subcommand": subcommand, "global_step": trainer.global_step, "log_dir": log_dir,
                              "metrics": metrics}), flush=True)

    def instantiate_classes(self) -> None:
        """The classes built from the config; the run writes under ``trainer.default_root_dir``
        (:mod:`mptrain.cli.run_dir`), and the saved config keeps its references to it."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        restore = place_run_under_root(config)
        try:
            fill_vocab_size(config)
            super().instantiate_classes()
        except CONSTRUCTION_ERRORS as e:
            raise ConfigError(one_line(innermost_error(str(e)))) from None
        except ImportError as e:  # a class needing an optional extra
            message = refusal(e, loop_started=False)
            if message is None:
                raise
            raise ConfigError(message) from e
        finally:
            restore()


_OTHER_CHECKPOINT = ("Resume from another checkpoint (--ckpt_path=FILE, e.g. an earlier .ckpt of the same "
                     "checkpoints/ folder), or leave --ckpt_path out to start afresh")


class _LoopStarted(Callback):
    """``value``: a loop (sanity check, training, validation, test, predict) has started; errors from then on are
    failures of the run, not refusals of its setup."""

    def __init__(self) -> None:
        self.value = False

    def _started(self, *args: Any) -> None:
        self.value = True

    on_sanity_check_start = on_train_start = on_validation_start = on_test_start = on_predict_start = _started


def _finish_wandb(trainer: Any) -> None:
    """Close the W&B runs of ``trainer``'s loggers (wandb otherwise does it at exit, printing after our last line)."""
    from lightning.pytorch.loggers import WandbLogger

    if trainer.is_global_zero and any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        import wandb

        wandb.finish()  # the current run, if one was started (nothing otherwise)

