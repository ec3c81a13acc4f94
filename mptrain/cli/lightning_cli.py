"""``mptrain fit|validate|test|predict``: Lightning's ``LightningCLI`` with mptrain's Trainer, unchanged
but for config mistakes, which become one line and exit 2 before anything is created: after parsing,
every ``class_path`` is checked against the kind its key expects, Trainer values Lightning would only
reject later are checked, ``--ckpt_path`` must exist, and a constructor's ``ValueError`` / ``TypeError``
/ ``MisconfigurationException`` becomes a ``ConfigError``.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI

from mptrain.cli.class_paths import check_class_paths
from mptrain.cli.errors import CONSTRUCTION_ERRORS, ConfigError, explain_parse_error, innermost_error, one_line, \
    parser_keys
from mptrain.cli.run_dir import place_run_under_root
from mptrain.cli.tools import TOOLS, tool_parser
from mptrain.cli.trainer_values import check_ckpt_path, check_trainer_values
from mptrain.cli.vocab import fill_vocab_size


class MptrainCLI(LightningCLI):
    """LightningCLI with ``mptrain.Trainer``, any LightningModule / LightningDataModule
    (``class_path``), the models' own ``configure_optimizers``, and a per-run saved config."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        from mptrain import Trainer

        # config.yaml goes to the run's own log dir (version_N); overwrite only matters without a logger
        defaults = dict(trainer_class=Trainer, subclass_mode_model=True, subclass_mode_data=True,
                        auto_configure_optimizers=False, save_config_kwargs={"overwrite": True})
        super().__init__(args=args, **{**defaults, **kwargs})

    def init_parser(self, **kwargs: Any):
        kwargs.setdefault("exit_on_error", False)  # main() turns the error into one line
        kwargs.setdefault("prog", "mptrain")
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
            sub_parser = self._subcommand_parsers.get(next((a for a in argv if a in self.subcommands()), None))
            keys = parser_keys(sub_parser) if sub_parser is not None else {"": list(self.subcommands())}
            raise ConfigError(explain_parse_error(str(e), keys)) from None

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
        """Lightning's run, then one machine-readable line: step, log dir, the run's metrics."""
        try:
            super()._run_subcommand(subcommand)
        except CONSTRUCTION_ERRORS as e:
            if self.trainer.state.stage is not None:  # a loop was running: a failure, keep the traceback
                raise
            # setup before any loop (prepare_data / setup / configure_optimizers): a config mistake
            raise ConfigError(f"during {subcommand} setup: {one_line(innermost_error(str(e)))}") from None
        trainer = self.trainer
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank asks
        if trainer.is_global_zero:
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
        finally:
            restore()

