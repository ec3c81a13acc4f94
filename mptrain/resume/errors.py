"""The one error of a checkpoint that cannot be used, and its missing-file kind."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, unsafe to unpickle, or does not fit the run resuming it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file does not exist: Lightning raises ``FileNotFoundError`` there, so this is one too."""
