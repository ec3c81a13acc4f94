"""Trainer values Lightning accepts at construction but fails on later (after the log dir
exists) or never: checked on the parsed config, before anything is built."""
from __future__ import annotations

import os
from typing import Any

from mptrain.cli.errors import ConfigError, bad_value

# key -> (predicate on a non-None value, what is valid)
_RULES = {
    "max_steps": (lambda v: v >= -1, "an int >= 0, or -1 (no step limit)"),
    "max_epochs": (lambda v: v >= -1, "an int >= 0, -1 (no epoch limit; then set max_steps) or null"),
    "min_steps": (lambda v: v >= 0, "an int >= 0 or null"),
    "min_epochs": (lambda v: v >= 0, "an int >= 0 or null"),
    "accumulate_grad_batches": (lambda v: v >= 1, "an int >= 1"),
    "gradient_clip_val": (lambda v: v >= 0, "a number >= 0 (0 or null: no clipping)"),
    "log_every_n_steps": (lambda v: v >= 1, "an int >= 1"),
    "check_val_every_n_epoch": (lambda v: v >= 1, "an int >= 1 or null"),
    "num_nodes": (lambda v: v >= 1, "an int >= 1"),
    "num_sanity_val_steps": (lambda v: v >= -1, "an int >= 0, or -1 (the whole validation set)"),
    **dict.fromkeys(("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"),
                    (lambda v: v >= 0 and (isinstance(v, int) or v <= 1.0),
                     "a fraction in [0.0, 1.0] or a batch count >= 0")),
}
# mptrain's own Trainer arguments are not listed: mptrain.Trainer.__init__ refuses bad values before
# anything is created, and the CLI turns that ValueError into the same one line.


def check_trainer_values(trainer: dict[str, Any]) -> None:
    for key, (ok, valid) in _RULES.items():
        value = trainer.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
            raise bad_value(f"trainer.{key}", value, valid)
    epochs, steps = trainer.get("max_epochs"), trainer.get("max_steps")
    if epochs == -1 and steps in (None, -1) and not trainer.get("max_time"):
        raise ConfigError("trainer.max_epochs=-1 (no epoch limit) with trainer.max_steps=-1 would train forever: "
                          "set --trainer.max_steps=N, --trainer.max_time, or max_epochs >= 1")
    _check_accelerator(trainer.get("accelerator"))


def _check_accelerator(accelerator: Any) -> None:
    """A GPU asked for on a machine without one: one line now, not Lightning's error later."""
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    if torch.cuda.is_available() or (accelerator == "gpu" and torch.backends.mps.is_available()):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "torch.cuda.is_available() is False"
    raise bad_value("trainer.accelerator", accelerator, f"cpu or auto on this machine: no GPU is visible ({why})")


def check_ckpt_path(ckpt_path: Any, subcommand: str) -> None:
    """A checkpoint path that does not exist fails now, not after the log dir was made.
    Lightning's keywords ("last", "best", "hpc", "registry") and URLs are left to it."""
    if (not isinstance(ckpt_path, str) or ckpt_path in ("last", "best", "hpc") or ckpt_path.startswith("registry")
            or "://" in ckpt_path or os.path.isfile(ckpt_path)):
        return
    what = "is a directory" if os.path.isdir(ckpt_path) else "does not exist"
    raise ConfigError(f"{subcommand} --ckpt_path={ckpt_path!r}: the file {what}. Valid: an existing .ckpt file, "
                      "'last' (the newest last.ckpt of this run's ModelCheckpoint), 'best', or null")
