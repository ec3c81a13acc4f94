"""The check every mptrain callback makes at setup: the trainer runs one of our precision plugins."""
from __future__ import annotations

from mptrain.precision.plugin import MptrainPrecision


def require_mptrain_plugin(trainer, callback: object) -> MptrainPrecision:
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MptrainPrecision):
        raise TypeError(
            f"{type(callback).__name__} needs one of mptrain's precision plugins, but the trainer runs "
            f"{type(plugin).__module__}.{type(plugin).__qualname__}. Use mptrain.Trainer(precision=...) or "
            f"lightning.Trainer(plugins=[mptrain.MasterPrecision('bf16-master')]) (any mptrain.precision_plugin(...))"
        )
    return plugin
