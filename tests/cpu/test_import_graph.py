"""The package's modules import each other without cycles, and none reaches into another's
private names.

Read from the source (nothing imported): every ``import`` / ``from ... import`` statement of every
module under ``hf_zero3/``, at any depth (a function-level import is a dependency too), resolved to
the module it names. A cycle means two modules that cannot be understood, tested or changed apart;
the fix is a layer, not a lazy import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_zero3"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import of an hf_zero3 module in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "hf_zero3"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hf_zero3":
                continue
            taken = []
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    out.append((f"{target}.{alias.name}", []))  # a submodule
                else:
                    taken.append(alias.name)
            if taken:
                out.append((target, taken))
    return [(t, names) for t, names in out if t in modules and t != name]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t, _ in _imports(name, path, modules)} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 30 and graph["hf_zero3.trainer.callback"], "the reader found the package"
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_takes_another_modules_private_names():
    """What one module uses of another is public (named in its ``__all__`` or at least not
    underscored); the ``_upstream`` readers are the package's own private layer and exempt."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            if target.startswith("hf_zero3._upstream") or target.rpartition(".")[0] == name.rpartition(".")[0]:
                continue  # the private layer, or a sibling in the same package
            native = {"_gate"} if target == "hf_zero3" else set()  # the compiled extension (setup.py)
            bad += [f"{name} takes {target}.{n}" for n in names if n.startswith("_") and n not in native]
    assert not bad, bad


def _module_aliases(name: str, path: Path, modules: dict[str, Path]) -> dict[str, str]:
    """Local names in ``path`` bound to another hf_zero3 module (``from . import agree``,
    ``from ..kernels import gqa_decode as g``, ``import hf_zero3.runtime as rt``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    out[alias.asname or alias.name] = f"{target}.{alias.name}"
    return out


def test_no_module_reads_another_modules_private_attributes():
    """The same rule for attribute reads: ``gqa_decode._state`` from another package is a private
    read (a module's own package and the ``_upstream`` layer exempt)."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        aliases = _module_aliases(name, path, modules)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            target = aliases.get(node.value.id)
            if target is None or target.startswith("hf_zero3._upstream"):
                continue
            if target.rpartition(".")[0] == name.rpartition(".")[0]:
                continue  # a sibling in the same package
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{name} reads {target}.{node.attr}")
    assert not bad, sorted(set(bad))
