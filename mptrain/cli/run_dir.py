"""One flag says where a run writes: ``trainer.default_root_dir`` (the recipes set ``runs/<recipe>``).

Lightning puts checkpoints under the first logger's directory (``default_root_dir`` without a logger), and the
saved ``config.yaml`` in the logger's ``log_dir``; a logger writes where its own ``save_dir`` says.  So before the
classes are built:

* every string value holding ``${trainer.default_root_dir}`` (the recipes' ``logger.init_args.save_dir``, a
  ``ModelCheckpoint``'s ``dirpath: ${trainer.default_root_dir}/best``) gets the run's root in its place;
* a logger whose ``save_dir`` is left at its class's default (``WandbLogger``'s ``"."``) and that names no
  ``dir`` writes under the root too.

A logger given an explicit path keeps it.  Any other ``${...}`` is refused: nothing else is substituted.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable

from jsonargparse import Namespace

from mptrain.cli.errors import ConfigError, resolve

ROOT_KEY = "${trainer.default_root_dir}"
_OTHER_REFERENCE = re.compile(r"\$\{[^}]*\}")


def run_root(trainer: Any) -> str:
    """The run's root: ``trainer.default_root_dir``, or "." (Lightning's default, the current directory)."""
    root = _get(trainer, "default_root_dir")
    if isinstance(root, str) and "${" in root:
        raise ConfigError(f"trainer.default_root_dir={root!r}: the root cannot refer to itself or another key; "
                          "give it a path")
    return "." if root is None else str(root)


def place_run_under_root(config: Any) -> Callable[[], None]:
    """Substitute the root in ``config`` (a parsed jsonargparse Namespace of one subcommand, changed in place) and
    point loggers left at their default ``save_dir`` at it.  Returns the function that puts the config back as
    given (the saved ``config.yaml`` keeps ``${trainer.default_root_dir}``: it follows the flag when run again)."""
    changes: list[tuple[Any, Any, Any]] = []  # (container, key, value as given)
    trainer = _get(config, "trainer")
    if trainer is not None:
        root = run_root(trainer)
        _substitute(config, root, "", changes)
        loggers = _get(trainer, "logger")
        for i, logger in enumerate(loggers if isinstance(loggers, list) else [loggers]):
            where = f"trainer.logger[{i}]" if isinstance(loggers, list) else "trainer.logger"
            _default_save_dir_to_root(logger, root, where, changes)

    def restore() -> None:
        for container, key, value in reversed(changes):
            container[key] = value

    return restore


def _substitute(node: Any, root: str, where: str, changes: list) -> None:
    """The root in place of ROOT_KEY in every string ``node`` (a Namespace, dict or list) holds, at any depth."""
    keys = range(len(node)) if isinstance(node, list) else list(node.keys())  # a Namespace's keys: dotted leaves
    for k in keys:
        value, key = node[k], (f"{where}[{k}]" if isinstance(node, list) else f"{where}.{k}" if where else k)
        if isinstance(value, (list, dict, Namespace)):
            _substitute(value, root, key, changes)
        elif isinstance(value, str) and "${" in value:
            rest = _OTHER_REFERENCE.search(value.replace(ROOT_KEY, ""))
            if rest:
                raise ConfigError(f"{key}={value!r}: {rest.group(0)!r} is not substituted; the only reference a "
                                  f"config may hold is {ROOT_KEY} (the run's root directory)")
            changes.append((node, k, value))
            node[k] = value.replace(ROOT_KEY, root)


def _default_save_dir_to_root(logger: Any, root: str, where: str, changes: list) -> None:
    """``save_dir`` of a logger config (``{class_path, init_args}``) left at its class's default, with no ``dir``:
    the root."""
    class_path = _get(logger, "class_path")
    init_args = _get(logger, "init_args")
    if not isinstance(class_path, str) or init_args is None:
        return
    try:
        params = inspect.signature(resolve(class_path, where)).parameters
    except (ConfigError, TypeError, ValueError):
        return
    save_dir = params.get("save_dir")
    if save_dir is None or save_dir.default is inspect.Parameter.empty:
        return
    given = _get(init_args, "save_dir", save_dir.default)
    if given == save_dir.default and _get(init_args, "dir") is None:
        changes.append((init_args, "save_dir", given))
        init_args["save_dir"] = root


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` of a Namespace or dict, ``default`` when absent."""
    if isinstance(node, (dict, Namespace)):
        return node[key] if key in node else default
    return default  # not a mapping (a bool logger, None)
