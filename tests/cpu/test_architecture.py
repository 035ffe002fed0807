"""``docs/architecture.md`` held to the code, claim by claim: its module table names every module
(and only those), and each dependency rule it states is read from the import statements (nothing
imported). The environment-reads table and the private-name rules are checked in
``test_import_graph.py``."""

from __future__ import annotations

import ast
import re

from test_import_graph import ARCHITECTURE, PACKAGE, _graph, _modules

PAGE = ARCHITECTURE.read_text(encoding="utf-8")
#: at most this many imports inside functions, each with its reason in a comment
FUNCTION_IMPORTS = 40


def _table_rows() -> dict[str, str]:
    """The Modules table: first cell (``name.py`` or ``name/``) -> the row's text."""
    section = PAGE.split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_module_table_names_every_module_and_package_and_no_other():
    rows = _table_rows()
    top = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top |= {p.name for p in PACKAGE.glob("*.py")}
    assert set(rows) == top, f"missing rows {sorted(top - set(rows))}, rows of nothing {sorted(set(rows) - top)}"


def test_each_package_row_names_its_modules():
    """A package's row names each of its modules (``__init__.py`` and ``_upstream/``'s contract
    modules aside: that row describes them by what they read)."""
    rows = _table_rows()
    missing = []
    for name, text in rows.items():
        if not name.endswith("/") or name == "_upstream/":
            continue
        for path in sorted((PACKAGE / name).glob("*.py")):
            if path.name != "__init__.py" and f"`{path.name}`" not in text:
                missing.append(f"{name}{path.name}")
    assert not missing, f"modules the architecture page's table does not name: {missing}"


def test_decode_never_imports_generation():
    graph = _graph()
    back = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("hf_zero3.decode") for t in ts)
    back = [b for b in back if "hf_zero3.generation" in b.split(" -> ")[1]]
    assert "`generation/` calls `decode/`, which never imports it back" in PAGE
    assert not back, back


def test_kernels_import_nothing_else_of_the_package():
    graph = _graph()
    out = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.startswith("hf_zero3.kernels")
        for t in ts
        if not t.startswith("hf_zero3.kernels")
    )
    assert "`kernels/` imports nothing else from the package" in PAGE
    assert not out, out


def test_only_the_trl_entry_imports_the_trainer_layer():
    graph = _graph()
    importers = sorted(
        m
        for m, ts in graph.items()
        if not m.startswith("hf_zero3.trainer")
        and any(t == "hf_zero3.trainer" or t.startswith("hf_zero3.trainer.") for t in ts)
    )
    assert "`trl/` sits above it" in PAGE
    assert importers == ["hf_zero3.trl"], importers


def test_the_decode_path_is_decided_in_the_plan_alone():
    """The static loop's eligibility and the region rule are called by ``decode/plan.py`` only, and
    lockstep's generation hooks ask the plan (``plan(`` in each hook that decides)."""
    callers = []
    for name, path in _modules().items():
        if name == "hf_zero3.decode.plan":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "unsupported" and ast.unparse(node.func.value) in ("eligibility", "static_loop"):
                    callers.append(f"{name}:{node.lineno}")
    assert not callers, f"the loop's eligibility asked outside the plan: {callers}"
    lockstep = (PACKAGE / "generation" / "lockstep.py").read_text(encoding="utf-8")
    for hook in ("def generate(", "def _valid_auto_compile_criteria(", "def _sample("):
        body = lockstep.split(hook, 1)[1].split("\n    def ", 1)[0]
        assert "decode_plan.plan(" in body, hook
    assert "`plan()`: every decision of which decode path a call takes" in PAGE


def test_agreements_of_a_call_live_in_its_call_object():
    """``generation/call.py`` holds a call's agreements; ``lockstep.py`` runs none itself."""
    lockstep = ast.parse((PACKAGE / "generation" / "lockstep.py").read_text(encoding="utf-8"))
    direct = [
        node.lineno
        for node in ast.walk(lockstep)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("agree", "_agree")
    ]
    assert not direct, f"lockstep.py agrees itself at lines {direct}"
    assert re.search(r"`call\.py`: `LockstepCall`, one call's agreements", PAGE)


def _function_imports() -> list[tuple[str, int, str]]:
    """(module, line, the line and the one before it) of every import inside a function."""
    out = []
    for name, path in _modules().items():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.append((name, node.lineno, lines[node.lineno - 2] + "\n" + lines[node.lineno - 1]))
    return sorted(set(out))


def test_imports_sit_at_module_level_unless_a_reason_is_named():
    found = _function_imports()
    assert len(found) <= FUNCTION_IMPORTS, f"{len(found)} imports inside functions: {[f[:2] for f in found]}"
    silent = [f"{m}:{line}" for m, line, text in found if "#" not in text]
    assert not silent, f"imports inside functions without their reason in a comment: {silent}"


#: each of the runtime's records and the one module that writes it (runtime.py's docstrings)
RECORD_WRITERS = {
    "generation": "hf_zero3.generation.lockstep",
    "eval": "hf_zero3.gathering",
    "memory": "hf_zero3.compile.memory_plan",
    "trl": "hf_zero3.trainer.trl_adapter",
}


def test_each_runtime_record_has_one_writer():
    """An assignment to ``<runtime>.<record>.<field>`` (or a ``setattr`` on the record) appears only
    in the record's writer module."""
    writes = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                targets = [t.value for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                targets = [node.args[0]]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in RECORD_WRITERS:
                    writes.append((t.attr, name, node.lineno))
    assert {record for record, _, _ in writes} == set(RECORD_WRITERS), writes  # the scan sees every record
    strangers = [
        f"{module}:{line} writes .{record}" for record, module, line in writes if module != RECORD_WRITERS[record]
    ]
    assert not strangers, strangers
    runtime = (PACKAGE / "runtime.py").read_text(encoding="utf-8")
    for record, module in RECORD_WRITERS.items():
        assert f"written by :mod:`{module}` alone" in runtime, record


def _runtime_names(tree: ast.AST, package: bool) -> set[str]:
    """Names a file binds to a runtime: ``rt`` in the package (its convention), and anywhere a name
    assigned from ``runtime_of(...)``."""
    names = {"rt"} if package else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if ast.unparse(node.value.func).split(".")[-1] == "runtime_of":
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_runtime(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "runtime_of"


def test_every_runtime_access_names_an_attribute_the_runtime_has():
    """``rt.<name>`` and ``rt.<record>.<field>`` (``rt``: a runtime, or ``runtime_of(...)``) in the
    package, the examples, the benchmarks and the GPU tests name what :class:`Runtime` and its
    records define: a renamed field read only on a GPU path (DeepCompile's forward wrapper, an
    example's last line) fails here, not in a user's run."""
    import dataclasses

    import torch

    from hf_zero3 import runtime

    state = vars(runtime.Runtime(torch.nn.Identity()))
    top = set(dir(runtime.Runtime)) | set(state)
    records = {
        name: {f.name for f in dataclasses.fields(type(value))} | set(dir(type(value)))
        for name, value in state.items()
        if dataclasses.is_dataclass(value)
    }
    assert set(records) == set(RECORD_WRITERS), records
    root = PACKAGE.parent
    files = [(name, path, True) for name, path in _modules().items()] + [
        (str(path.relative_to(root)), path, False)
        for folder in ("examples", "benchmarks", "tests/gpu")
        for path in sorted((root / folder).rglob("*.py"))
    ]
    unknown, seen = [], set()
    for name, path, package in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = _runtime_names(tree, package)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) >= 2:
                target, attr = node.args[0], node.args[1]
                if _is_runtime(target, names) and isinstance(attr, ast.Constant) and attr.value not in top:
                    unknown.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            if not isinstance(node, ast.Attribute):
                continue
            if _is_runtime(node.value, names):
                seen.add(name)
                if node.attr not in top:
                    unknown.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            inner = node.value
            if isinstance(inner, ast.Attribute) and _is_runtime(inner.value, names) and inner.attr in records:
                if node.attr not in records[inner.attr]:
                    unknown.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    # the scan reads the package's runtime accesses and those outside it
    assert len(seen) > 10 and {"examples/trl_grpo.py", "tests/gpu/_runtime_workers.py"} <= seen, seen
    assert not unknown, unknown
