"""mptrain imports strictly downward: the graph of which mptrain module imports which (read from the sources with
ast, imports inside functions included) has no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mptrain"


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> source file of every module under ``package`` (a package is its __init__.py)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for annotations, never run."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not _type_checking_only(node):
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mptrain modules ``name`` names in its imports: ``from a.b import c`` is ``a.b.c`` when that is a module,
    else ``a.b``; a relative import is resolved against ``name``'s package.  The parent packages Python runs first
    are not edges: a submodule importing its own package's __init__ implicitly is how packages work."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]):
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, iters = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_mptrain_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "mptrain.cli.lightning_cli" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("sources, cycle", [
    ({"a.py": "from . import b\n", "b.py": "def f():\n    from .a import g\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    ({"a.py": "import pkg.b\n", "b.py": "from pkg import c\n", "c.py": "from pkg.a import x\n"},
     ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
      "b.py": "from pkg.a import A\n"}, None),
    ({"__init__.py": "from pkg.a import A\n", "a.py": "from pkg.b import B\n", "b.py": "X = 1\n"}, None),
    ({"__init__.py": "from pkg.a import A\n", "a.py": "from pkg import X\n"}, ["pkg", "pkg.a", "pkg"]),
])
def test_the_walk_finds_cycles_through_any_import_form(tmp_path, sources, cycle):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in sources.items():
        (pkg / name).write_text(text)
    assert find_cycle(import_graph(pkg)) == cycle
