"""The package's modules import each other without cycles, and none reaches into another's
private names.

Read from the source (nothing imported): every ``import`` / ``from ... import`` statement of every
module under ``hf_zero3/``, at any depth (a function-level import is a dependency too; one under
``if TYPE_CHECKING:`` is for annotations only and is not), resolved to the module it names. A
cycle means two modules that cannot be understood, tested or changed apart; the fix is a layer,
not a lazy import.
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


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for annotations
    only: no module runs them, so they are no dependency)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import of an hf_zero3 module in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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
    """What one module uses of another is public (not underscored), siblings in one package
    included; the ``_upstream`` readers are the package's own private layer and exempt."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            if target.startswith("hf_zero3._upstream"):
                continue  # the private layer
            bad += [f"{name} takes {target}.{n}" for n in names if _private(n)]
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
    read, from a sibling module too (the ``_upstream`` layer exempt)."""
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
            if _private(node.attr):
                bad.append(f"{name} reads {target}.{node.attr}")
    assert not bad, sorted(set(bad))


# -- the architecture page's rules, held to the code (docs/architecture.md) ----------------------

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
#: Underscored names of other libraries that are their public API by convention.
PUBLIC_BY_CONVENTION = {"os._exit"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _names_defined_in_the_package(trees) -> set[str]:
    """Every name the package itself defines or binds: its own underscored attributes are its own."""
    ours = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
            elif isinstance(node, ast.alias):
                ours.add((node.asname or node.name).split(".")[0])
    return ours


def _foreign_private_reads(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Per module outside ``_upstream/``: reads of another library's underscored attribute or
    module (``torch._dynamo``, ``m._forward_hooks``, ``from torch._inductor import ...``)."""
    paths = sorted(root.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    ours = _names_defined_in_the_package(trees.values())
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        if rel.startswith("_upstream/"):
            continue
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    what = ast.unparse(node)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] != "hf_zero3" and any(map(_private, node.module.split("."))):
                    what = f"from {node.module} import"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "hf_zero3" and any(map(_private, alias.name.split("."))):
                        what = f"import {alias.name}"
            if what is not None and what not in PUBLIC_BY_CONVENTION:
                found.setdefault(rel, []).append(f"{rel}:{node.lineno}: {what}")
    return found


def test_only_upstream_reads_other_libraries_private_attributes():
    """The architecture page's rule: every read of a private attribute of DeepSpeed, transformers,
    accelerate, TRL or torch lives in ``_upstream/``, one accessor each."""
    assert "Only `_upstream/` touches private attributes" in ARCHITECTURE.read_text()
    found = _foreign_private_reads()
    assert not found, [line for lines in found.values() for line in lines]


def test_the_private_read_finder_finds_one(tmp_path):
    code = "import torch\nfrom torch._inductor import config\n\ndef f(m):\n    return m._forward_hooks, torch._dynamo\n"
    (tmp_path / "_upstream").mkdir()
    (tmp_path / "_upstream" / "torch.py").write_text(code)
    (tmp_path / "mod.py").write_text(code + "\nclass C:\n    def g(self, o):\n        o._own = self._own = 1\n")
    found = _foreign_private_reads(tmp_path)
    assert list(found) == ["mod.py"], found
    assert [line.split(": ", 1)[1] for line in found["mod.py"]] == [
        "from torch._inductor import",
        "m._forward_hooks",
        "torch._dynamo",
    ], found


def _environment_readers() -> set[str]:
    """Modules (paths under hf_zero3/) that touch ``os.environ`` or call ``os.getenv``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.add(path.relative_to(PACKAGE).as_posix())
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                if any(a.name in ("environ", "getenv") for a in node.names):
                    found.add(path.relative_to(PACKAGE).as_posix())
    return found


def test_the_architecture_page_lists_every_module_that_reads_the_environment():
    """Its "Environment reads" table names exactly the modules that read ``os.environ``."""
    text = ARCHITECTURE.read_text()
    assert "## Environment reads" in text
    section = text.split("## Environment reads", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("`") and cells[0].endswith(".py`"):
            listed.add(cells[0].strip("`"))
    readers = _environment_readers()
    assert readers, "the reader found the package"
    assert listed == readers, (
        f"read but not listed: {sorted(readers - listed)}; listed, not read: {sorted(listed - readers)}"
    )
