"""AtomicCheckpointIO: Lightning's ``CheckpointIO`` entry point to :mod:`mptrain.resume.files`."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

from lightning.pytorch.plugins.io import TorchCheckpointIO

from mptrain.resume.errors import CheckpointError
from mptrain.resume.files import atomic_save, verified_load


class AtomicCheckpointIO(TorchCheckpointIO):
    """A Lightning ``CheckpointIO`` plugin: atomic local writes, ``weights_only`` verified reads; remote
    (``scheme://``) paths and ``storage_options`` go through Lightning's ``TorchCheckpointIO``.  Whatever Lightning
    hands over is written (a full checkpoint, or the bare weights ``strategy="ddp_spawn"`` passes back).
    ``mptrain.Trainer`` adds it by default."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if _is_remote(path) or storage_options is not None:  # Lightning refuses storage_options, with its message
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path: Union[str, os.PathLike],
                        map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if _is_remote(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        if weights_only is False:
            raise CheckpointError(f"refused to load {str(path)!r} with weights_only=False: AtomicCheckpointIO only "
                                  "unpickles tensors and plain containers (register extra types with "
                                  "torch.serialization.add_safe_globals)")
        return verified_load(path, map_location)


def _is_remote(path: Union[str, os.PathLike]) -> bool:
    return "://" in str(path)
