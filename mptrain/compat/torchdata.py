"""torchdata's private names, each behind one small function saying which public API is missing.  Imports only
torchdata."""
from __future__ import annotations

from typing import Any, Optional


def live_iterator(loader: Any) -> Optional[Any]:
    """The iterator a ``StatefulDataLoader`` keeps (None when none is alive).
    Missing public API: the loader does not expose whether it holds an iterator."""
    return loader._iterator


def drop_iterator(loader: Any) -> None:
    """Let go of the iterator a ``StatefulDataLoader`` built only to read its state (its workers shut down), so the
    next ``iter()`` starts where the loader's state says.
    Missing public API: ``state_dict()`` without an iterator builds one and keeps it."""
    iterator = loader._iterator
    loader._iterator = None
    loader._initial_iter_for_state_dict = False
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
