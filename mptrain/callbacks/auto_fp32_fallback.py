"""AutoFp32Fallback: promote a module whose output overflows to fp32 for the rest of the run.

Leaf modules' outputs are checked for inf/NaN on the device; the precision plugin reads the flags where it syncs
anyway and promotes the earliest offender in execution order (the culprit, not what is downstream of it).  Each
promotion is logged as a line and counted in the metric ``auto_fp32_promoted``.
"""
from __future__ import annotations

import logging

from lightning.pytorch import Callback

from mptrain.callbacks._plugin import require_mptrain_plugin

log = logging.getLogger("mptrain")


class AutoFp32Fallback(Callback):
    """Watch leaf modules for inf/NaN outputs and promote the offender to fp32 (half modes only)."""

    def __init__(self):
        self._plugin = None
        self._seen: list[str] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._plugin = require_mptrain_plugin(trainer, self)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._plugin.enable_auto_fallback(pl_module)
        self._seen = self._plugin.promoted

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        promoted = self._plugin.promoted  # host-side list: no device read
        if new := [n for n in promoted if n not in self._seen]:
            log.info("auto_fp32_fallback: %s now in fp32 (step %d)", ", ".join(map(repr, new)), trainer.global_step)
        self._seen = promoted
        pl_module.log("auto_fp32_promoted", float(len(promoted)), on_step=True, on_epoch=False)
