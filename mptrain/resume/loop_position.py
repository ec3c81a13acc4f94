"""Where in its epoch a checkpoint was written, in the one form Lightning resumes exactly.

Lightning saves the loops' progress and the train loader's position as they are when the checkpoint is written, and
the same position reads differently depending on where it was written: inside the last batch's
``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps=...)``), in ``on_train_epoch_end`` (the default
checkpoint) or after ``fit`` returned.  Resumed as saved, Lightning either skips the next epoch's start (its hooks and
progress counters), or replays the loader's exhausted iterator (0 batches, or the leftovers of a
``limit_train_batches`` epoch), or builds the next epoch's iterator before the RNG is restored (another shuffle,
other dropout masks); after a ``fit`` stopped mid-epoch (``max_steps``, ``should_stop``) it counts the epoch as
finished and drops the rest of it.

:func:`settle_epoch_end` rewrites an epoch-end state into one form, the epoch finished, so Lightning starts the next
epoch as the uninterrupted run did, and takes the loaders' states out of Lightning's hands; :func:`begin_next_epoch`
(at ``on_train_start``, after the RNG is restored) rebuilds each loader's saved epoch without drawing from the RNGs,
so that what lasts across epochs (a sampler's own generator, a stateful dataset, persistent workers) is where that
epoch left it, and defers the next epoch's iterator to the first batch: it is built at the moment, and from the RNG
state, the uninterrupted run built it.  :func:`reopen_stopped_epoch` rewrites the state of a ``fit`` stopped
mid-epoch into the form of a checkpoint written at the same batch, which Lightning resumes mid-epoch.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from lightning.pytorch.utilities import rank_zero_warn

from mptrain.compat.lightning import (combined_loader, data_fetcher, is_stateful, saved_batches_that_stepped,
                                      set_saved_batches_that_stepped, stop_restarting)
from mptrain.resume.errors import CheckpointError
from mptrain.resume.rng import preserved_rng

_EPOCHS = "epoch_progress"
_BATCHES = "epoch_loop.batch_progress"
_EPOCH_LOOP = "epoch_loop.state_dict"
_VAL_BATCHES = "epoch_loop.val_loop.batch_progress"


def ends_an_epoch(fit_loop: dict[str, Any]) -> bool:
    """Whether a checkpoint's fit-loop state was written after its epoch's last batch (Lightning's own flag), and
    not inside the validation that follows it (Lightning resumes that validation where it stopped)."""
    batches = fit_loop.get(_BATCHES)
    return (isinstance(batches, dict) and bool(batches.get("is_last_batch")) and isinstance(fit_loop.get(_EPOCHS), dict)
            and not _mid_evaluation(fit_loop))


def _mid_evaluation(fit_loop: dict[str, Any]) -> bool:
    """A validation batch started and not finished: Lightning's test for a restart mid-evaluation."""
    progress = fit_loop.get(_VAL_BATCHES)
    total = progress.get("total") if isinstance(progress, dict) else None
    return isinstance(total, dict) and total["started"] == total["ready"] and \
        total["processed"] == total["started"] - 1 and total["completed"] == total["processed"]


def stopped_mid_epoch(fit_loop: dict[str, Any]) -> bool:
    """Whether a checkpoint's fit-loop state was written after a ``fit`` that stopped inside an epoch."""
    epochs, batches = fit_loop.get(_EPOCHS), fit_loop.get(_BATCHES)
    if not (isinstance(epochs, dict) and isinstance(batches, dict)) or batches.get("is_last_batch"):
        return False
    epoch, batch = epochs["current"], batches["current"]
    return epoch["processed"] == epoch["started"] > 0 and batch["completed"] == batch["processed"] > 0


def reopen_stopped_epoch(fit_loop: dict[str, Any], accumulate_grad_batches: int) -> None:
    """Rewrite the state of a ``fit`` stopped mid-epoch (see :func:`stopped_mid_epoch`) into that of a checkpoint
    written in its last batch's ``on_train_batch_end``, in place: the epoch in progress, the batch not yet closed."""
    for progress in fit_loop[_EPOCHS].values():
        progress.update(processed=progress["started"] - 1, completed=progress["started"] - 1)
    batches = fit_loop[_BATCHES]
    for progress in (batches["total"], batches["current"]):
        progress["completed"] = progress["processed"] - 1
    if batches["current"]["ready"] % accumulate_grad_batches == 0:  # it stepped; Lightning counts it again
        loop_state = fit_loop.setdefault(_EPOCH_LOOP, {})
        set_saved_batches_that_stepped(loop_state, saved_batches_that_stepped(loop_state, 1) - 1)


def settle_epoch_end(fit_loop: dict[str, Any]) -> list[dict[str, Any]]:
    """Rewrite an epoch-end fit-loop state (see :func:`ends_an_epoch`) into Lightning's "epoch finished" form, in
    place, and return the train loaders' saved states (removed from it: Lightning would replay them)."""
    epochs = fit_loop[_EPOCHS]["total"]
    batches = fit_loop[_BATCHES]
    total = batches["total"]
    # written inside the last batch: in its on_train_batch_end, or in the validation that follows it (the epoch is
    # not yet processed); Lightning counts the batch as stepped only after both
    inside_last_batch = total["completed"] < total["processed"] or epochs["processed"] < epochs["started"]
    for progress in fit_loop[_EPOCHS].values():  # "total" and "current": the started epoch is over
        progress.update(ready=progress["started"], processed=progress["started"], completed=progress["started"])
    if inside_last_batch:
        loop_state = fit_loop.setdefault(_EPOCH_LOOP, {})
        # the last batch of an epoch always steps
        set_saved_batches_that_stepped(loop_state, saved_batches_that_stepped(loop_state, 0) + 1)
        total["completed"] = total["processed"]
    batches["current"] = dict.fromkeys(batches["current"], 0)  # the next epoch has seen no batch
    batches["is_last_batch"] = False
    return fit_loop.get("state_dict", {}).pop("combined_loader", None) or []


def begin_next_epoch(trainer: Any, loader_states: list[dict[str, Any]], same_layout: bool = True,
                     iterate_unsized: bool = True) -> None:
    """Start the epoch after a settled checkpoint's (call at ``on_train_start``, after the RNG is restored).

    ``same_layout``: the run has the checkpoint's epoch layout (world size, batches per epoch); with another, the
    saved epoch is not rebuilt (its state may not even fit the new sampler) and the next epoch starts afresh.
    ``iterate_unsized=False``: Lightning built a loader without length's iterator after the RNG was restored
    (:meth:`ResumeState.before_train_iterator`), so that iterator is the next epoch's already."""
    fit_loop = trainer.fit_loop
    combined = combined_loader(fit_loop)
    fetcher = data_fetcher(fit_loop)
    if combined is None or fetcher is None:  # nothing to train (limit_train_batches=0, no training_step)
        return
    if same_layout:
        _rebuild_saved_epoch(trainer, [loader for loader in combined.flattened if is_stateful(loader)],
                             loader_states)
    if fetcher.length is None:  # no length: Lightning reads a batch ahead from the moment it builds the iterator
        if iterate_unsized:
            iter(fetcher)
    else:
        fetcher.iterator = _IterOnFirstBatch(combined)
    # with max_steps Lightning restarts every loop of a resumed run (FitLoop's setter insists); the settled state
    # is a fresh epoch's start, whose end steps the plateau schedulers as the uninterrupted run's did
    stop_restarting(fit_loop)


def _rebuild_saved_epoch(trainer: Any, loaders: list[Any], states: list[dict[str, Any]]) -> None:
    """Each loader rebuilt at the saved epoch's end, drawing nothing the uninterrupted run drew; a state that does
    not fit its loader (another sampler or dataset) is dropped with a warning."""
    if len(loaders) != len(states):
        raise CheckpointError(f"checkpoint {trainer.ckpt_path!r} holds the state of {len(states)} train loader(s) "
                              f"with state, this run has {len(loaders)}: resume with the same train loaders")
    with preserved_rng():
        for loader, state in zip(loaders, states):
            try:
                loader.load_state_dict(_unfinished(state))
                iter(loader)
            except Exception as e:  # noqa: BLE001 - torchdata's checks are bare asserts and key lookups
                if hasattr(loader, "next_iter_state"):
                    loader.next_iter_state = None  # else the next iterator retries the state
                rank_zero_warn(f"the train loader state in checkpoint {trainer.ckpt_path!r} does not fit this run's "
                               f"{type(loader).__name__} ({type(e).__name__}: {e}); the next epoch starts from a new "
                               f"iterator, so its order may differ from the uninterrupted run's")


def _unfinished(state: dict[str, Any]) -> dict[str, Any]:
    """A torchdata loader state marked finished would begin one more epoch while being rebuilt."""
    return dict(state, _iterator_finished=False) if state.get("_iterator_finished") else state


class _IterOnFirstBatch(Iterator[Any]):
    """Iterates the combined train loader when the first batch is fetched, as Lightning does at an epoch's start."""

    def __init__(self, combined: Any):
        self.combined = combined
        self.iterator: Optional[Iterator[Any]] = None

    def __next__(self) -> Any:
        if self.iterator is None:
            self.iterator = iter(self.combined)
        return next(self.iterator)
