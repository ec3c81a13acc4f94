"""``mptrain numerics``: a jsonargparse parser in the flag style of ``mptrain fit`` (snake_case,
``--config``, dotted overrides; docs/cli.md lists the flags).  It reads a recipe as ``mptrain fit``
does and compares its model layer by layer on one batch (:func:`mptrain.numerics.compare_layerwise`),
or with ``--fp8`` reports what fp8-master's casts do (:func:`mptrain.numerics.fp8_report`), or with ``--rounding``
which share of an optimizer step's updates bf16 round-to-nearest would lose
(:func:`mptrain.numerics.rounding.rounding_loss`: bf16-sr or bf16-master rather than bf16-true)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from jsonargparse import ActionConfigFile, ArgumentParser
from lightning_utilities.core.apply_func import apply_to_collection

from mptrain.cli.class_paths import check_class_paths
from mptrain.cli.errors import CONSTRUCTION_ERRORS, ConfigError, bad_value, innermost_error, one_line
from mptrain.cli.vocab import fill_vocab_size
from mptrain.numerics.evaluate import LABEL_KEYS
from mptrain.numerics.layerwise import compare_layerwise
from mptrain.precision import PRECISIONS, normalize_precision
from mptrain.trainer import Trainer


def numerics_parser():
    parser = ArgumentParser(prog="mptrain numerics", exit_on_error=False, allow_abbrev=False,
                            description="Layerwise fp32-vs-low-precision comparison of a recipe's model on one batch.")
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="a recipe (the one `mptrain fit` takes)")
    parser.add_argument("--seed_everything", type=Union[bool, int], default=0, help="seed of the model's init")
    parser.add_class_arguments(Trainer, "trainer", instantiate=False, fail_untyped=False)
    parser.add_subclass_arguments(pl.LightningModule, "model", required=True)
    parser.add_subclass_arguments(pl.LightningDataModule, "data", required=True)
    parser.add_argument("--precision", type=Optional[str], default=None,
                        help="precision to compare against fp32; null: the recipe's trainer.precision")
    parser.add_argument("--device", type=Optional[str], default=None, help="null: cuda if available, else cpu")
    parser.add_argument("--max_samples", type=int, default=8, help="use at most this many samples of the batch")
    parser.add_argument("--rtol", type=Optional[float], default=None,
                        help="relative tolerance; null: from the dtype's rounding and each layer's depth")
    parser.add_argument("--atol", type=Optional[float], default=None,
                        help="absolute tolerance; null: rtol times each output's RMS")
    parser.add_argument("--backward", type=bool, default=False, help="compare gradients too")
    parser.add_argument("--train_mode", type=bool, default=False, help="keep training mode (BatchNorm batch stats)")
    parser.add_argument("--top", type=Optional[int], default=None, help="print only the N worst modules")
    parser.add_argument("--json", type=Optional[str], default=None, help="write the report as JSON to this path")
    parser.add_argument("--fp8", type=bool, default=False, help="instead: what fp8-master's casts do to each linear "
                        "layer's input, weight and output grad over --steps forward+backward passes (docs/numerics.md)")
    parser.add_argument("--fp8_recipe", type=Literal["tensorwise", "delayed", "rowwise"], default="tensorwise",
                        help="with --fp8: the fp8-master recipe (delayed: x and dY at scales from their amax history)")
    parser.add_argument("--fp8_scaling", type=Optional[Literal["current", "delayed"]], default=None,
                        help="with --fp8: current (the default: tensorwise's and rowwise's) or delayed (from the amax "
                             "of the 16 previous calls; --fp8_recipe=delayed's own)")
    parser.add_argument("--steps", type=int, default=4, help="with --fp8: training batches to run")
    parser.add_argument("--rounding", type=bool, default=False,
                        help="instead: per parameter group, the share of one optimizer step's updates that bf16 "
                             "round-to-nearest (bf16-true) would lose, on one training batch in fp32")
    parser.add_argument("--rounding_lr", type=Optional[float], default=None,
                        help="with --rounding: evaluate at this learning rate (e.g. the schedule's last) instead of "
                             "the optimizer's first")
    return parser


def batch_to_input(model: Any, batch: Any) -> Any:
    """What ``model.forward`` takes: the model's own ``numerics_input(batch)`` if it has one,
    else the first element of a tuple batch, or a dict batch without its label keys."""
    if hasattr(model, "numerics_input"):
        return model.numerics_input(batch)
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k not in LABEL_KEYS}
    return batch


def build_model_and_batch(parser, cfg) -> tuple[Any, Any]:
    """The recipe's model and one training batch of its data."""
    model, data = build_model_and_data(parser, cfg)
    return model, next(iter(data.train_dataloader()))


def build_model_and_data(parser, cfg) -> tuple[Any, Any]:
    """The recipe's model and its data module set up for fit (class paths checked before anything is built)."""
    plain = cfg.clone().as_dict()
    check_class_paths({k: plain.get(k) for k in ("model", "data")}, object)
    if cfg.seed_everything is not False:
        pl.seed_everything(None if cfg.seed_everything is True else int(cfg.seed_everything), verbose=False)
    try:
        fill_vocab_size(cfg)
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse >= 4.49
        built = instantiate(cfg)
    except CONSTRUCTION_ERRORS as e:
        raise ConfigError(one_line(innermost_error(str(e)))) from None
    built.data.prepare_data()
    built.data.setup("fit")
    return built.model, built.data


def numerics_main(argv: Optional[list[str]] = None) -> int:
    parser = numerics_parser()
    cfg = parser.parse_args(argv)
    if cfg.fp8:
        return fp8_main(parser, cfg)
    if cfg.rounding:
        return rounding_main(parser, cfg)
    precision = cfg.precision or cfg.trainer.get("precision") or "bf16-mixed"
    try:
        precision = normalize_precision(precision)
    except ValueError:
        raise bad_value("precision", precision, ", ".join(PRECISIONS)) from None
    model, batch = build_model_and_batch(parser, cfg)
    model = model.to(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    example = apply_to_collection(batch_to_input(model, batch), torch.Tensor,
                                  lambda t: t[:cfg.max_samples] if t.dim() else t)
    report = compare_layerwise(model, example, precision=str(precision), rtol=cfg.rtol, atol=cfg.atol,
                               backward=cfg.backward, train_mode=cfg.train_mode)
    if cfg.json:
        Path(cfg.json).write_text(report.to_json())
        print(f"wrote {cfg.json}")
    print(report.table(top=cfg.top))  # its last line: the worst module and why
    return 0


def fp8_main(parser, cfg) -> int:
    """``mptrain numerics --fp8``: the recipe's model in fp32 over ``--steps`` of its training batches
    (forward and backward, no optimizer step), and what fp8-master's casts do to its linear layers."""
    from mptrain.numerics.fp8 import fp8_report

    layerwise = [k for k in ("precision", "rtol", "atol") if cfg[k] is not None] + \
        [k for k in ("backward", "train_mode") if cfg[k]]
    if layerwise:
        raise ConfigError(f"--{layerwise[0]} is an option of the layerwise comparison; --fp8 always runs forward and "
                          f"backward in training mode on whole batches: drop --{layerwise[0]}")
    if cfg.steps < 1:
        raise bad_value("steps", cfg.steps, "an integer >= 1")
    if cfg.fp8_scaling == "delayed" and cfg.fp8_recipe == "rowwise":
        raise ConfigError("--fp8_scaling=delayed keeps one amax history per tensor: "
                          "use it with --fp8_recipe=tensorwise")
    if cfg.fp8_scaling == "current" and cfg.fp8_recipe == "delayed":
        raise ConfigError("--fp8_recipe=delayed casts with delayed scales: drop --fp8_scaling=current, or use "
                          "--fp8_recipe=tensorwise")
    model, data = build_model_and_data(parser, cfg)
    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise ConfigError(f"--fp8: {type(model).__name__} has no nn.Linear layer (fp8-master converts only those)")
    model = model.to(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = fp8_report(model, data.train_dataloader(), steps=cfg.steps, recipe=cfg.fp8_recipe,
                        scaling=cfg.fp8_scaling)
    if cfg.json:
        Path(cfg.json).write_text(report.to_json())
        print(f"wrote {cfg.json}")
    print(report.table(top=cfg.top))  # its last line: the summary and the keep_bf16 advice
    return 0


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of whatever ``configure_optimizers`` returned (Lightning's forms)."""
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        first = configured[0]
        return _first_optimizer(first[0] if isinstance(first, (list, tuple)) else first)
    if not isinstance(configured, torch.optim.Optimizer):
        raise ConfigError(f"--rounding: configure_optimizers() returned {type(configured).__name__}, not an optimizer")
    return configured


def rounding_main(parser, cfg) -> int:
    """``mptrain numerics --rounding``: the recipe's model in fp32 and its optimizer on one training batch; per
    parameter group, the share of the step's updates bf16 round-to-nearest would lose (nothing is stepped)."""
    from mptrain.numerics.rounding import format_rounding_report, rounding_loss

    if cfg.rounding_lr is not None and not cfg.rounding_lr > 0:
        raise bad_value("rounding_lr", cfg.rounding_lr, "a learning rate > 0")
    model, batch = build_model_and_batch(parser, cfg)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device)
    batch = apply_to_collection(batch, torch.Tensor, lambda t: t.to(device))
    try:
        optimizer = _first_optimizer(model.configure_optimizers())
    except (AttributeError, RuntimeError, TypeError) as e:  # e.g. a schedule that asks the trainer for its length
        raise ConfigError(f"--rounding: {type(model).__name__}.configure_optimizers() failed outside a trainer: "
                          f"{one_line(str(e))}") from None
    if cfg.rounding_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = cfg.rounding_lr

    def loss() -> torch.Tensor:
        out = model.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    model.train()
    rows = rounding_loss(model, optimizer, loss_fn=loss)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps([r.to_dict() for r in rows], indent=2))
        print(f"wrote {cfg.json}")
    print(format_rounding_report(rows))  # its last line: the advice
    return 0
