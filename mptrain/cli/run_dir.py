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
import os
import re
from typing import Any, Callable, Iterator, Optional

from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import SaveConfigCallback

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


def run_folder(trainer: Any) -> str:
    """This run's own folder: where Lightning puts its checkpoints (``ModelCheckpoint`` without ``dirpath``), its
    ``config.yaml`` and, for CSV and TensorBoard loggers, its metrics.  With a logger it is Lightning's
    ``<save_dir>/<name>/<version>`` of the first logger (``version_N``; W&B's run id), else
    ``default_root_dir``.  Every rank gets rank zero's answer."""
    folder = None
    if trainer.is_global_zero:
        if not trainer.loggers:
            folder = str(trainer.default_root_dir)
        else:
            logger = trainer.loggers[0]
            save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            version = logger.version
            version = version if isinstance(version, str) else f"version_{version}"
            folder = os.path.join(str(save_dir), str(logger.name), version)
    return trainer.strategy.broadcast(folder)


class RunConfigCallback(SaveConfigCallback):
    """LightningCLI's ``SaveConfigCallback`` writing ``config.yaml`` into the run's own folder (:func:`run_folder`),
    also for loggers whose ``log_dir`` is shared by every run (W&B's is its ``save_dir``)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            folder = run_folder(trainer)
            if trainer.is_global_zero:
                fs = get_filesystem(folder)
                fs.makedirs(folder, exist_ok=True)
                self.parser.save(self.config, os.path.join(folder, self.config_filename), skip_none=False,
                                 overwrite=self.overwrite, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)


def run_roots(trainer: Any) -> list[str]:
    """Every folder a run writes under: the root, each logger's directory, an explicit checkpoint ``dirpath``,
    W&B's directory."""
    roots = [trainer.default_root_dir, os.environ.get("WANDB_DIR")]
    for logger in trainer.loggers:
        roots += [getattr(logger, "root_dir", None), logger.save_dir]
    roots += [getattr(cb, "dirpath", None) for cb in trainer.callbacks]
    return [str(r) for r in roots if isinstance(r, (str, os.PathLike))]


def run_own_paths(trainer: Any) -> tuple[list[str], list[str]]:
    """(the run's own folders, the ids naming its W&B run folders): ``trainer.log_dir``, each logger's
    ``log_dir``, and each W&B logger's run id."""
    dirs, ids = [], []
    for value in [getattr(trainer, "log_dir", None)] + [getattr(lg, "log_dir", None) for lg in trainer.loggers]:
        if isinstance(value, (str, os.PathLike)):
            dirs.append(str(value))
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            version = logger.version
            if isinstance(version, str):
                ids.append(version)
    return dirs, ids


class RunFiles:
    """The files and folders that exist under a run's roots, so that a refused run can take back what it created
    (the saved config, a logger's version folder, W&B's offline run); what existed before is never touched, nor
    what another run writes meanwhile under the same roots: only paths inside the run's own folders (and W&B
    run folders named with the run's id) are removed, and the new folders above them when empty.  Roots holding
    more than ``limit`` entries are not scanned (then nothing is removed)."""

    def __init__(self, roots: list[str], limit: int = 50_000) -> None:
        self.roots, self.limit = sorted({os.path.abspath(r) for r in roots}), limit
        self.before = self._scan()

    def _scan(self) -> Optional[set[str]]:
        """Every existing path under the roots, the roots and their ancestors."""
        seen: set[str] = set()
        for root in self.roots:
            seen.update(p for p in (root, *_parents(root)) if os.path.exists(p))
            for dirpath, dirnames, filenames in os.walk(root):
                seen.update(os.path.join(dirpath, n) for n in dirnames + filenames)
                if len(seen) > self.limit:
                    return None
        return seen

    def remove_new(self, own_dirs: list[str], own_ids: list[str] = ()) -> list[str]:
        """Remove what was created since this object was made inside ``own_dirs`` (the run's folders) or in a
        folder whose name holds one of ``own_ids`` (W&B's ``offline-run-<time>-<id>``), then the new folders
        above those that are empty; returns the removed paths."""
        after = self._scan() if self.before is not None else None
        if after is None:
            return []
        own_dirs = [os.path.abspath(d) for d in own_dirs]
        ids = [i for i in own_ids if i]

        def owned(path: str) -> bool:
            if any(path == d or path.startswith(d + os.sep) for d in own_dirs):
                return True
            return any(part.endswith(f"-{i}") for part in path.split(os.sep) for i in ids)

        new = after - self.before
        mine = {p for p in new if owned(p)}
        above = {parent for p in mine for parent in _parents(p) if parent in new}  # emptied folders we made
        removed = []
        for path in sorted(mine | above, key=lambda p: (p.count(os.sep), p), reverse=True):  # deepest first
            try:
                if path in mine and (os.path.islink(path) or os.path.isfile(path)):
                    os.unlink(path)
                elif os.path.isdir(path):
                    os.rmdir(path)  # only when empty: another run's files in it are kept
                else:
                    continue
                removed.append(path)
            except OSError:
                pass
        return removed


def _parents(path: str) -> Iterator[str]:
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        yield parent
        path = parent


def keep_wandb_files_in_the_run(trainer: Any) -> None:
    """W&B's files under the run's root, not the home directory: its run folders go to the WandbLogger's
    ``save_dir`` (the root unless the config names another), and, unless set already, ``WANDB_DIR`` and
    ``WANDB_CACHE_DIR`` (where wandb's service writes its debug logs, and its artifact cache) point under it
    too.  Called before the W&B run starts."""
    from lightning.pytorch.loggers import WandbLogger

    wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    if not wandb:
        return
    save_dir = os.path.abspath(str(wandb[0].save_dir if wandb[0].save_dir is not None else trainer.default_root_dir))
    os.environ.setdefault("WANDB_DIR", save_dir)
    os.environ.setdefault("WANDB_CACHE_DIR", os.path.join(save_dir, "wandb", "cache"))
