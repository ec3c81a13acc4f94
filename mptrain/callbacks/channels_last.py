"""ChannelsLast: the module and every 4-D floating input batch in ``torch.channels_last``."""
from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t


class ChannelsLast(Callback):
    """Converts the module at ``setup`` and each batch after it reaches the device.

    The batch conversion wraps the module's own ``on_after_batch_transfer`` (a user's override still runs first)
    until ``teardown``."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        pl_module.to(memory_format=torch.channels_last)
        own = pl_module.on_after_batch_transfer

        def on_after_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
            return apply_to_collection(own(batch, dataloader_idx), torch.Tensor, _to_channels_last)

        pl_module.on_after_batch_transfer = on_after_batch_transfer

    def teardown(self, trainer, pl_module, stage: str) -> None:
        pl_module.__dict__.pop("on_after_batch_transfer", None)
