"""Recipe files checked before jsonargparse reads them: a binary file, a tab in the
indentation, a YAML syntax error or a ``!!python/...`` tag each give one line naming the
file, the line and the fix (jsonargparse's own messages for these are many lines or none)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import yaml

from mptrain.cli.errors import ConfigError

_PYTHON_TAG = re.compile(r"!!?python/|!<tag:yaml\.org,2002:python/")


def config_paths(argv: list[str]) -> Iterator[str]:
    """The values of ``--config`` / ``-c`` (also ``--config=X`` and ``--model.config X``)."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("-c", "--config") or key.endswith(".config"):
            if eq:
                yield value
            elif i + 1 < len(argv):
                yield argv[i + 1]


def check_config_file(path: str) -> None:
    """Raise ConfigError unless ``path`` is a readable, text, safe YAML mapping; a value that looks
    like inline YAML (``--config '{...}'``, which jsonargparse accepts) is checked the same way."""
    if not Path(path).exists() and (":" in path or path.strip().startswith("{")):
        return _check_text(path, path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"--config {path!r}: cannot read the recipe ({e.strerror or e})") from None
    if (nul := data.find(b"\x00")) >= 0:
        raise ConfigError(f"--config {path!r}: binary content (byte {nul} is NUL); a recipe is a YAML text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path!r}: not UTF-8 text (byte {e.start}); a recipe is a YAML text file") from None
    _check_text(path, text)


def _check_text(path: str, text: str) -> None:
    for n, line in enumerate(text.splitlines(), 1):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent:
            raise ConfigError(f"--config {path!r} line {n}: a tab in the indentation; YAML indents with spaces only")
        if _PYTHON_TAG.search(line):
            raise ConfigError(f"--config {path!r} line {n}: the Python tag in {line.strip()!r} is refused (a recipe "
                              "never constructs Python objects); name classes with class_path + init_args")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path!r}{where}: YAML syntax error: {problem}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"--config {path!r}: a recipe is a YAML mapping (seed_everything, trainer, model, data), "
                          f"got a {type(loaded).__name__}")
