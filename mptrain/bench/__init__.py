"""Benchmarks, each reached as ``mptrain bench NAME [options]`` (also ``python -m mptrain.bench.NAME``): every
module here with a ``main(argv)`` is one (:func:`benchmarks`), and they share one harness
(:mod:`mptrain.bench.common`: the parser, CUDA-event and host timers, the result table, the JSON file)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Optional

#: modules with a ``main`` that are not benchmarks of their own
_NOT_BENCHMARKS = {"ddp_lightning": "one rank of `mptrain bench ddp`, started by torchrun"}


def benchmarks() -> dict[str, str]:
    """Name -> one line on what it measures, for every benchmark module (read from the sources: nothing is
    imported, so ``mptrain bench --help`` is instant)."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        name = path.stem
        if name.startswith("_") or name in _NOT_BENCHMARKS or name == "common":
            continue
        tree = ast.parse(path.read_text(), str(path))
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip()
        first = re.sub(r"^`[^`]*`:\s*", "", " ".join(doc.split("\n\n")[0].split()))  # without "`mptrain bench x`: "
        first = re.sub(r" \([^()]*\)", "", first.split(". ")[0]).split(": ")[0].rstrip(".")  # no asides
        out[name] = first[:1].lower() + first[1:] if first[1:2].islower() else first
    return out


def run(name: str, argv: Optional[list[str]] = None) -> int:
    """Run benchmark ``name`` with its own arguments; its exit status."""
    return int(importlib.import_module(f"mptrain.bench.{name}").main(list(argv or [])) or 0)
