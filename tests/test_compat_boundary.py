"""Only ``mptrain/compat/`` touches private names of Lightning, torch and torchdata.

A private name is an import of a module with a ``_``-prefixed segment under those packages, a ``_``-prefixed name
imported from them, or an attribute access ``x._name`` (single underscore, not dunder) whose name the installed
packages define (a ``_``-prefixed function, class, assignment or ``self._x`` attribute in their sources) and mptrain
itself does not (an mptrain attribute that happens to share a name with a dependency's is mptrain's own).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

import pytest

DEPENDENCIES = ("lightning", "torch", "torchdata")
MPTRAIN = Path(__file__).resolve().parents[1] / "mptrain"
COMPAT = MPTRAIN / "compat"


# Python's own public API spelled with one underscore (namedtuple's methods), private nowhere
PYTHON_PUBLIC = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PYTHON_PUBLIC


def _defined_names(tree: ast.Module) -> set[str]:
    """``_``-prefixed names a module defines: functions, classes, module-level assignments, ``self._x`` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    bodies = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for node in (statement for body in bodies for statement in body):  # module and class level assignments
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in names if _private(n)}


def _parse(path: Path):
    try:
        return ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def dependency_private_names() -> frozenset[str]:
    names: set[str] = set()
    for package in DEPENDENCIES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for path in Path(root).rglob("*.py"):
                tree = _parse(path)
                if tree is not None:
                    names |= _defined_names(tree)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def mptrain_private_names() -> frozenset[str]:
    names: set[str] = set()
    for path in _mptrain_files():
        tree = _parse(path)
        if tree is not None:
            names |= _defined_names(tree)
    return frozenset(names)


def _is_dependency(module: str) -> bool:
    return module.split(".")[0] in DEPENDENCIES


def violations(source: str, dependency_names: frozenset[str], own_names: frozenset[str]) -> list[str]:
    """Each private use of a dependency in ``source``: ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_dependency(alias.name) and any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_dependency(node.module):
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in dependency_names and node.attr not in own_names:
                found.append(f"{node.lineno}: .{node.attr}")
    return found


def _mptrain_files() -> list[Path]:
    return sorted(p for p in MPTRAIN.rglob("*.py") if COMPAT not in p.parents)


def test_private_names_of_dependencies_are_used_only_in_compat():
    dependency_names, own_names = dependency_private_names(), mptrain_private_names()
    report = []
    for path in _mptrain_files():
        for line in violations(path.read_text(encoding="utf-8"), dependency_names, own_names):
            report.append(f"{path.relative_to(MPTRAIN.parent)}:{line}")
    assert not report, "private names of lightning/torch/torchdata outside mptrain/compat/:\n" + "\n".join(report)


@pytest.mark.parametrize("snippet, expected", [
    ("from lightning.pytorch.loops.loop import _Loop", ["1: from lightning.pytorch.loops.loop import _Loop"]),
    ("import torch._dynamo", ["1: import torch._dynamo"]),
    ("from torch._C import foo", ["1: from torch._C import ..."]),
    ("def f(trainer):\n    return trainer.fit_loop._combined_loader", ["2: ._combined_loader"]),
    ("def f(it):\n    it._shutdown_workers()", ["2: ._shutdown_workers"]),
    ("import lightning\nfrom torch import nn\nx = nn.Linear(2, 2).__class__", []),
    ("def f(self):\n    return self._mine", []),  # a name only mptrain defines
    ("from mptrain.compat.lightning import combined_loader", []),
])
def test_the_check_finds_a_synthetic_violation(snippet, expected):
    dependency_names = frozenset({"_Loop", "_combined_loader", "_shutdown_workers", "_mine"})
    assert violations(snippet, dependency_names, own_names=frozenset({"_mine"})) == expected


def test_the_dependency_names_are_collected_from_the_installed_sources():
    names = dependency_private_names()
    assert {"_combined_loader", "_data_fetcher", "_prepare_dataloader", "_shutdown_workers"} <= names
