"""No code from YAML: before anything is instantiated, every ``class_path`` in a parsed config must
name a class of the kind its key expects (``class_path: os.system`` under ``trainer.callbacks`` is
refused and never runs).  A ``class_path`` under a key typed ``Any`` is refused too: nothing says
what it may be."""
from __future__ import annotations

import inspect
import typing
from typing import Any, Optional

from mptrain.cli.errors import ConfigError, resolve


def _expected_bases() -> dict[str, tuple[type, ...]]:
    """Key -> the base classes a class_path there (or in a list there) must subclass."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.plugins import LayerSync
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.profilers import Profiler
    from lightning.pytorch.strategies import Strategy

    return {
        "model": (pl.LightningModule,),
        "data": (pl.LightningDataModule,),
        "trainer.callbacks": (pl.Callback,),
        "trainer.logger": (Logger,),
        "trainer.profiler": (Profiler,),
        "trainer.plugins": (Precision, CheckpointIO, ClusterEnvironment, LayerSync),
        "trainer.strategy": (Strategy,),
        "trainer.accelerator": (Accelerator,),
        "optimizer": (torch.optim.Optimizer,),
        "lr_scheduler": (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau),
    }


def _classes_in(hint: Any) -> tuple[type, ...]:
    """The classes an annotation allows (``Optional[X]``, ``Union[X, Y]``, ``list[X]``)."""
    if inspect.isclass(hint) and hint is not typing.Any:
        return (hint,)
    out = [c for arg in typing.get_args(hint) for c in _classes_in(arg)]
    return tuple(c for c in out if c is not type(None) and c not in (str, int, float, bool, dict, list))


def check_class(class_path: str, bases: tuple[type, ...], where: str) -> type:
    obj = resolve(class_path, where)
    if not (inspect.isclass(obj) and issubclass(obj, bases)):
        kind = type(obj).__name__ if not inspect.isclass(obj) else f"class {obj.__module__}.{obj.__qualname__}"
        wanted = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases)
        raise ConfigError(f"{where}.class_path={class_path!r} is refused: it is a {kind}, not a subclass of {wanted} "
                          "(a config may only name classes of the kind its key expects)")
    return obj


def check_class_paths(config: dict, trainer_class: type) -> None:
    """Walk a parsed config (plain dicts/lists) and check every ``class_path`` it holds.
    Trainer arguments outside the table above take the kind their annotation names
    (``max_time: Union[str, timedelta, dict, None]`` -> timedelta)."""
    bases = _expected_bases()
    hints = {key: hint for klass in reversed(trainer_class.__mro__) if "__init__" in vars(klass)
             for key, hint in _init_hints(klass).items()}  # a subclass's annotation wins
    for key, hint in hints.items():
        if classes := _classes_in(hint):
            bases.setdefault(f"trainer.{key}", classes)
    _walk(config, "", None, bases)


def _walk(node: Any, path: str, hint_bases: Optional[tuple[type, ...]], bases: dict) -> None:
    expected = bases.get(path) or hint_bases  # what a class_path here, or in a list here, must be
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{path}[{i}]", expected, bases)
    elif isinstance(node, dict) and isinstance(node.get("class_path"), str):
        if not expected:
            raise ConfigError(f"{path}.class_path={node['class_path']!r} is refused: {path!r} does not declare what "
                              "kind of class it takes (untyped argument); pass a plain value")
        hints = _init_hints(check_class(node["class_path"], expected, path))
        for key, value in (node.get("init_args") or {}).items():
            _walk(value, f"{path}.init_args.{key}", _classes_in(hints.get(key)) or None, bases)
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(value, f"{path}.{key}" if path else key, None, bases)


def _init_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: nested class_paths are then refused
        return {}
