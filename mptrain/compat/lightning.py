"""Lightning's private names, each behind one small function saying which public API is missing.  Imports only
Lightning."""
from __future__ import annotations

import typing
from typing import Any, Callable, Optional

from lightning.pytorch.loops.fit_loop import _FitLoop


def precision_inputs() -> tuple[Any, ...]:
    """Every value ``lightning.pytorch.Trainer(precision=...)`` accepts.
    Missing public API: the accepted precision values (only the private ``_PRECISION_INPUT`` type lists them)."""
    from lightning.fabric.connector import _PRECISION_INPUT

    return tuple(value for literal in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(literal))


def combined_loader(fit_loop: Any) -> Optional[Any]:
    """The fit loop's ``CombinedLoader`` of train loaders (None before ``setup_data``).
    Missing public API: ``FitLoop`` exposes no accessor for its combined loader."""
    return fit_loop._combined_loader


def data_fetcher(fit_loop: Any) -> Optional[Any]:
    """The fit loop's data fetcher (None outside ``fit``).  Missing public API: no accessor for it."""
    return fit_loop._data_fetcher


def loader_states(combined: Any) -> list[dict[str, Any]]:
    """The states of a ``CombinedLoader``'s stateful loaders, as the fit loop saves them.
    Missing public API: ``CombinedLoader._state_dicts`` is the only reader."""
    return combined._state_dicts()


def stop_restarting(loop: Any) -> None:
    """Mark ``loop`` as not restarting, bypassing ``FitLoop``'s setter (which insists on restarting a resumed
    ``max_steps`` run).  Missing public API: a settable restart state."""
    from lightning.pytorch.loops.loop import _Loop

    _Loop.restarting.fset(loop, False)


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict`` / ``load_state_dict`` as Lightning's loops test it.
    Missing public API: the ``_Stateful`` protocol is private."""
    from lightning.fabric.utilities.types import _Stateful

    return isinstance(obj, _Stateful)


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on a loader's sampler and batch sampler, as Lightning does at each epoch's start.
    Missing public API: ``_set_sampler_epoch`` is private."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(dataloader, epoch)


def wrap_dataloader_preparation(trainer: Any, wrap: Callable[[Any, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the data connector's ``_prepare_dataloader(dataloader, shuffle, mode)`` (where Lightning injects
    samplers) by ``wrap(connector, prepare)``, ``prepare`` being Lightning's own.
    Missing public API: no hook between the preparation of a loader and its use."""
    connector = trainer._data_connector
    connector._prepare_dataloader = wrap(connector, prepare_dataloader)


def prepare_dataloader(connector: Any, dataloader: Any, shuffle: bool, mode: Any) -> Any:
    """Lightning's own preparation of a loader (see :func:`wrap_dataloader_preparation`)."""
    return type(connector)._prepare_dataloader(connector, dataloader, shuffle=shuffle, mode=mode)


def last_checkpoints(callback: Any, trainer: Any) -> set[str]:
    """The "last" checkpoints a ``ModelCheckpoint`` finds in its own folder (``ckpt_path="last"``'s candidates).
    Missing public API: ``ModelCheckpoint._find_last_checkpoints`` is private."""
    return set(callback._find_last_checkpoints(trainer))


_BATCHES_THAT_STEPPED = "_batches_that_stepped"  # the epoch loop's saved count of batches that stepped


def saved_batches_that_stepped(epoch_loop_state: dict[str, Any], default: int) -> int:
    """The count of batches that stepped (the logger's step) in a saved epoch loop state.
    Missing public API: the key is the private attribute's name."""
    return epoch_loop_state.get(_BATCHES_THAT_STEPPED, default)


def set_saved_batches_that_stepped(epoch_loop_state: dict[str, Any], value: int) -> None:
    """Set the count :func:`saved_batches_that_stepped` reads."""
    epoch_loop_state[_BATCHES_THAT_STEPPED] = value


def default_dtype(dtype: Any) -> Any:
    """A context in which new floating tensors default to ``dtype`` (Lightning's half ``*-true`` init context).
    Missing public API: ``_DtypeContextManager`` is private."""
    from lightning.fabric.plugins.precision.utils import _DtypeContextManager

    return _DtypeContextManager(dtype)


def convert_fp_tensor(tensor: Any, dtype: Any) -> Any:
    """A floating tensor cast to ``dtype`` (others unchanged), as Lightning's precision plugins cast inputs.
    Missing public API: ``_convert_fp_tensor`` is private."""
    from lightning.fabric.plugins.precision.utils import _convert_fp_tensor

    return _convert_fp_tensor(tensor, dtype)


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """Lightning's step between the closure and the update: ``on_before_optimizer_step`` hooks, then clipping.
    Missing public API: ``Precision._after_closure`` is private."""
    plugin._after_closure(model, optimizer)


def is_unset_wrapping_io(io: Any) -> bool:
    """A wrapping ``CheckpointIO`` (e.g. ``AsyncCheckpointIO()``) not yet given the IO it wraps.
    Missing public API: ``_WrappingCheckpointIO`` is private."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    return isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None


def before_train_iterator(fit_loop: Any, hook: Callable[[], None]) -> None:
    """Call ``hook()`` in the fit loop's ``setup_data`` right before Lightning builds the train iterator (the
    loaders' saved states loaded).  Needs :func:`report_pending_loader_states`' fit loop.
    Missing public API: no hook between loading the loaders' states and building their iterator."""
    if isinstance(fit_loop, _PendingStatesFitLoop):
        fit_loop.before_train_iterator = hook


def report_pending_loader_states(fit_loop: Any) -> None:
    """Make ``fit_loop.state_dict()`` report the train loader states it was loaded with and has not yet handed to
    its loaders (Lightning reports the live loaders' states, so a loaded state does not round-trip with stateful
    loaders).  Missing public API: the pending states (``_combined_loader_states_to_load``) are private."""
    if type(fit_loop) is _FitLoop:  # a user's own fit loop is left alone
        fit_loop.__class__ = _PendingStatesFitLoop


class _PendingStatesFitLoop(_FitLoop):
    """Lightning's fit loop whose saved state holds the loader states loaded and not yet applied, with a hook
    before the train iterator is built (:func:`before_train_iterator`)."""

    before_train_iterator: Optional[Callable[[], None]] = None

    def _load_combined_loader_states(self) -> None:
        super()._load_combined_loader_states()
        if self.before_train_iterator is not None:
            self.before_train_iterator()

    def on_save_checkpoint(self) -> dict:
        state = super().on_save_checkpoint()
        if self._combined_loader_states_to_load:
            state["combined_loader"] = list(self._combined_loader_states_to_load)
        return state


def subcommand_parser(cli: Any, subcommand: Optional[str]) -> Optional[Any]:
    """The parser ``LightningCLI`` built for ``subcommand`` (None for an unknown one).
    Missing public API: ``LightningCLI._subcommand_parsers`` is private."""
    return cli._subcommand_parsers.get(subcommand)
