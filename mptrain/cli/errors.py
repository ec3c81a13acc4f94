"""Config mistakes and refusals as one line: ``ConfigError``, the rewording of jsonargparse's and
Lightning's multi-line messages into "key, value, what is valid", and :func:`refusal`, which says
which errors raised while a run is set up are refusals (reported the same way) rather than failures
(reported with their traceback)."""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from lightning.pytorch.utilities.exceptions import MisconfigurationException

#: errors of a class's constructor that mean "this config cannot work"
CONSTRUCTION_ERRORS = (ValueError, TypeError, MisconfigurationException)


class ConfigError(ValueError):
    """A recipe or override that cannot work: reported as one line, exit status 2, before
    anything (log dir, checkpoint dir) is created."""


#: the optional extras (pyproject.toml): module a user may lack -> (extra, what it brings)
EXTRAS = {
    "torchao": ("fp8", "torchao's float8 linears for precision='fp8-master' and `mptrain numerics --fp8`"),
    "wandb": ("wandb", "Weights & Biases logging through Lightning's WandbLogger"),
    "torchvision": ("vision", "torchvision's ResNets and image folders (recipes/resnet50.yaml)"),
    "transformers": ("nlp", "transformers' BERT and Llama (recipes/bert_*.yaml, recipes/llama_1b.yaml)"),
    "tokenizers": ("nlp", "the WordPiece tokenizer of the text recipes"),
}

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # mptrain/


def missing_extra(error: ImportError) -> Optional[str]:
    """One line for an optional dependency that is not installed, naming the extra that brings it; None
    for any other ImportError (a broken install is a failure, with its traceback)."""
    text = str(error)
    if "pip install" in text:  # mptrain's own ImportErrors name what to install
        return one_line(text)
    name = (getattr(error, "name", None) or "").split(".")[0]
    for module, (extra, brings) in EXTRAS.items():
        if name == module or re.search(rf"\b{module}\b", text):
            return (f"{module} is not installed ({one_line(text)}): pip install 'mptrain[{extra}]' "
                    f"(the [{extra}] extra: {brings})")
    return None


def raised_by_mptrain(error: BaseException) -> bool:
    """The ``raise`` that threw ``error`` is a line of mptrain's own code (a deliberate refusal, such as a
    precision mode the device lacks), not of torch or Lightning."""
    tb = error.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    try:
        return Path(last.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)
    except (OSError, ValueError):
        return False


def refusal(error: BaseException, loop_started: bool) -> Optional[str]:
    """The one line to print when ``error`` is a refusal, else None (a failure: its traceback is shown).

    Refusals: a damaged or unsafe checkpoint (``mptrain.CheckpointError``, whenever it comes); an optional
    extra that is not installed; and, before any loop ran (setup: the precision plugin's device checks, the
    Trainer's argument checks, the model's and data's ``setup``, restoring ``--ckpt_path``), a ``ValueError``,
    ``TypeError`` or Lightning ``MisconfigurationException``, or a ``RuntimeError`` that mptrain raised itself.
    Once a loop runs, an error is a failure of the run and keeps its traceback."""
    from mptrain.resume import CheckpointError

    if isinstance(error, CheckpointError):
        return one_line(error)
    if isinstance(error, ImportError):
        return missing_extra(error)
    if loop_started:
        return None
    if isinstance(error, CONSTRUCTION_ERRORS):
        return one_line(innermost_error(str(error)))
    if isinstance(error, RuntimeError) and raised_by_mptrain(error):
        return one_line(error)
    return None


def show_traceback() -> bool:
    """``MPTRAIN_TRACEBACK=1``: a refusal or config mistake is raised with its traceback instead of one line."""
    return os.environ.get("MPTRAIN_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no")


def resolve(class_path: str, where: str) -> Any:
    """The object ``class_path`` names (its module is imported; nothing is called)."""
    module, _, name = class_path.rpartition(".")
    if not module:
        raise ConfigError(f"{where}.class_path={class_path!r} must be a dotted path (package.module.Class)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}.class_path={class_path!r} cannot be imported: {e}") from None


def unknown_key(path: str, valid: Iterable[str], value: Any = None) -> ConfigError:
    """``path`` is not a key; suggest the closest valid one and list them all."""
    valid = sorted(set(valid))
    where, _, name = path.rpartition(".")
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    shown = "" if value is None else f" (value {value!r})"
    return ConfigError(f"unknown key {path!r}{shown}.{hint} Valid keys under {where or 'the top level'}: "
                       f"{', '.join(valid)}")


def bad_value(path: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"invalid value for {path!r}: {value!r}. Valid: {valid}")


def one_line(text: str) -> str:
    """Whitespace-collapsed ``text``: every message this CLI prints is a single line."""
    return " ".join(str(text).split())


def innermost_error(message: str) -> str:
    """The useful part of a jsonargparse message: the error a class's ``__init__`` raised,
    without the "Does not validate against any of the Union subtypes" wrapping."""
    items = re.findall(r"^\s*- (.+)$", message, re.M)
    if useful := [i for i in items if "Expected a <class 'NoneType'>" not in i and not i.startswith("Problem with")]:
        return useful[0]
    if problem := re.search(r"Problem with given class_path '([^']+)':\s*(.+)", message, re.S):
        return f"{problem.group(1)}: {problem.group(2)}"
    return message


def _init_params(class_path: str) -> list[str]:
    """The keyword arguments of an (already imported) class named in a parse error."""
    try:
        params = inspect.signature(resolve(class_path, "")).parameters
    except (ConfigError, TypeError, ValueError):
        return []
    return [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def parser_keys(parser) -> dict[str, list[str]]:
    """Group ("" for top-level keys) -> the keys a jsonargparse parser accepts (for the did-you-mean)."""
    keys: dict[str, list[str]] = {"": []}
    for action in parser._actions:
        dest = getattr(action, "dest", "")
        group, _, name = dest.partition(".")
        if dest and not dest.endswith(".help") and dest != "help":
            keys.setdefault(group if name else "", []).append(name or group)
    return keys


def _unknown(key: str, valid_keys: dict[str, list[str]], value: Any = None) -> str:
    """An unknown ``group.name`` against its group's keys, or an unknown group against the top level."""
    group = key.split(".")[0]
    if "." in key and group in valid_keys:
        return str(unknown_key(key, valid_keys[group], value))
    return str(unknown_key(group, valid_keys.get("", []), value))


def _clean_types(text: str) -> str:
    return re.sub(r"<class '([^']+)'>", r"\1", text).replace("NoneType", "null")


def explain_parse_error(message: str, valid_keys: Optional[dict[str, list[str]]] = None) -> str:
    """jsonargparse's ArgumentError as "key, value, expected": ``valid_keys`` maps a group
    ("trainer", "model", ...) to its keys, for the did-you-mean of an unknown key."""
    valid_keys = valid_keys or {}
    if unrec := re.search(r"nrecognized arguments: (\S+)", message):
        key, _, value = unrec.group(1).lstrip("-").partition("=")
        return _unknown(key, valid_keys, value or None)
    parser_key = re.search(r'Parser key "([^"]+)"', message)
    path = parser_key.group(1) if parser_key else ""
    if option := re.search(r"(?:Option|[Kk]ey) '([^']+)' is not (?:accepted|expected)", message):
        cls = re.search(r"Problem with given class_path '([^']+)'", message)
        valid = _init_params(cls.group(1)) if cls else valid_keys.get(path.split(".")[0], [])
        return str(unknown_key(f"{path}.{option.group(1)}" if path else option.group(1), valid))
    if unknown := re.search(r"(?:does not accept option '|No action for key \")([^'\"]+)", message):
        return _unknown(unknown.group(1), valid_keys)
    given = re.search(r"Given value: (.*)", message)
    expected = re.search(r"Expected a (.*?)(?:\. Got value: (.*))?$", message, re.M)
    subtypes = re.search(r"Subtypes: \[(.*?)\]", message, re.S)
    value = (given.group(1) if given else expected.group(2) if expected and expected.group(2) else "").strip()
    if not (subtypes or expected):
        return f"{path or 'config'}: {one_line(innermost_error(message))}"
    wanted = "one of " + _clean_types(subtypes.group(1)) if subtypes else _clean_types(expected.group(1))
    inner = innermost_error(message)
    detail = f" ({one_line(inner)})" if inner != message and "Expected a" not in inner else ""
    return f"invalid value for {path!r}: {value!r}. Expected {wanted}{detail}"
