"""Fp32Finetune: switch a run to ``32-true`` for its last epochs or steps, to polish what rounding left.

The switch keeps the optimizer state: params become fp32 (the masters' exact values where they exist), autocast and
the loss scaler go off.  The phase is in the plugin's checkpoint state: a resume after the switch resumes in fp32.
"""
from __future__ import annotations

import logging

from lightning.pytorch import Callback

from mptrain.callbacks._plugin import require_mptrain_plugin

log = logging.getLogger("mptrain")


class Fp32Finetune(Callback):
    """Run the last ``epochs`` epochs (epoch-based runs) or ``steps`` optimizer steps (``max_steps``) in fp32.

    Args:
        epochs: the switch happens at the start of epoch ``max_epochs - epochs``.
        steps: the switch happens when ``global_step`` reaches ``max_steps - steps``.
    """

    def __init__(self, epochs: int = 0, steps: int = 0):
        if int(epochs) < 0 or int(steps) < 0:
            raise ValueError(f"Fp32Finetune(epochs={epochs!r}, steps={steps!r}): both must be >= 0")
        if epochs and steps:
            raise ValueError(f"Fp32Finetune(epochs={epochs}, steps={steps}): give epochs (epoch-based runs) or "
                             f"steps (runs bounded by max_steps), not both")
        self.epochs, self.steps = int(epochs), int(steps)
        self._plugin = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._plugin = require_mptrain_plugin(trainer, self)
        if stage != "fit":
            return
        if self.epochs and trainer.max_epochs in (None, -1):
            raise ValueError(
                f"Fp32Finetune(epochs={self.epochs}) needs an epoch-based run, but this one is bounded by "
                f"max_steps={trainer.max_steps} (max_epochs={trainer.max_epochs}); use "
                f"fp32_finetune_steps / Fp32Finetune(steps=N) to run the last N optimizer steps in fp32")
        if self.steps and not (trainer.max_steps and trainer.max_steps > 0):
            raise ValueError(f"Fp32Finetune(steps={self.steps}) needs max_steps > 0 (got max_steps="
                             f"{trainer.max_steps}); use epochs=N in an epoch-based run")
        total, what = (trainer.max_epochs, "epochs") if self.epochs else (trainer.max_steps, "steps")
        if (self.epochs or self.steps) > total:
            raise ValueError(f"Fp32Finetune({what}={self.epochs or self.steps}) is more than the whole run "
                             f"(max_{what}={total}); use at most max_{what}, or precision='32-true'")

    def _due(self, trainer) -> bool:  # setup checked that the window fits in the run
        if self.epochs:
            return trainer.current_epoch >= trainer.max_epochs - self.epochs
        return bool(self.steps) and trainer.global_step >= trainer.max_steps - self.steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("precision_is_fp32", float(self._plugin.phase == "fp32"), on_step=True, on_epoch=False)
        if self.steps:  # right after the window's step: the next batch is converted for fp32 already
            self._maybe_switch(trainer, pl_module)

    def _maybe_switch(self, trainer, pl_module) -> None:
        if self._plugin.phase == "fp32" and self._plugin.precision == "32-true" or not self._due(trainer):
            return
        self._plugin.switch_to_fp32(pl_module, trainer.optimizers)
        _rewrap_ddp(trainer)
        log.info("epoch %d, step %d: switched to 32-true for the rest of the run", trainer.current_epoch,
                 trainer.global_step)

    on_train_start = on_train_epoch_start = _maybe_switch  # on_train_start: a resume past the switch point


def _rewrap_ddp(trainer) -> None:
    """DDP's gradient buckets were built for the old dtypes: wrap the module again."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy) and strategy.model is not strategy.lightning_module:
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()
