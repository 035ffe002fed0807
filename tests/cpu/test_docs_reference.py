"""The reference pages stay true to the code: environment variables, public names, options, errors.

Fast and local: source files are read as text or parsed with ``ast``; the only imports are the
package's own modules (no process is spawned, nothing is compiled or run).

* ``docs/reference/environment.md``: every ``HF_ZERO3_*`` name in ``hf_zero3/``, ``csrc/`` and
  ``setup.py`` (plus the memory plan's ``HF_ZERO3_<FIELD>`` names, built from its fields) is a row
  of the table, and every row names a variable the code reads;
* ``docs/reference/api.md``: every name of ``hf_zero3.__all__`` and of the public submodules'
  ``__all__`` has a ``::: module.Name`` entry that resolves to that very object;
* ``docs/reference/options.md``: every field of ``LockstepConfig``, ``MemoryPlanConfig`` and
  ``Zero3DeepSpeedPlugin`` and every keyword of ``Zero3Safe.__init__`` is a row of its section's
  table, with the code's default where the table gives Python defaults;
* ``docs/troubleshooting.md``: every exception class the package defines is a heading;
* ``docs/concepts/fast-decode.md``: every reason a decode fallback can report is listed.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "hf_zero3"

_ENV_NAME = re.compile(r"\bHF_ZERO3_[A-Z0-9_]*[A-Z0-9]\b")
_ENV_READ = re.compile(
    r"""(?:environ\.get|getenv)\(\s*["']([A-Z][A-Z0-9_]+)["']"""
    r"""|environ\[\s*["']([A-Z][A-Z0-9_]+)["']\s*\]"""
)
#: ``HF_ZERO3_*`` names in the sources that are not environment variables (documented as such on the page).
NOT_ENV = {"HF_ZERO3_WITH_CUDA"}  # a preprocessor define passed to the compiler as -DHF_ZERO3_WITH_CUDA


def _page(rel: str) -> str:
    path = DOCS / rel
    assert path.exists(), f"docs/{rel} is missing"
    return path.read_text(encoding="utf-8")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table_rows(text: str) -> list[list[str]]:
    """Cells of every body row of every Markdown table in ``text`` (header and rule rows skipped)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            continue
        if re.fullmatch(r"\s*\|[\s:|-]+\|\s*", line):
            continue  # the rule under a header
        if i + 1 < len(lines) and re.fullmatch(r"\s*\|[\s:|-]+\|\s*", lines[i + 1]):
            continue  # a header
        rows.append(_cells(line))
    return rows


def _sections(text: str) -> dict[str, str]:
    """``## heading`` (backticks dropped) -> the text under it, up to the next ``## ``."""
    out, name, buf = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^##\s+(.*)$", line)
        if m:
            if name is not None:
                out[name] = "\n".join(buf)
            name, buf = m.group(1).replace("`", "").strip(), []
        elif name is not None:
            buf.append(line)
    if name is not None:
        out[name] = "\n".join(buf)
    return out


def _ticked(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]+)`", cell.strip())
    return m.group(1) if m else None


# -- (a) environment variables ------------------------------------------------------------------


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "csrc").rglob("*"))
    files.append(ROOT / "setup.py")
    return [f for f in files if f.is_file() and f.suffix in (".py", ".cpp", ".h", ".cu", ".cuh")]


def _source_env_names() -> set[str]:
    return {m.group(0) for f in _sources() for m in _ENV_NAME.finditer(f.read_text(encoding="utf-8"))}


def _memory_plan_env_names() -> set[str]:
    from hf_zero3.compile.config import MemoryPlanConfig, _env_name

    return {_env_name(f.name) for f in dataclasses.fields(MemoryPlanConfig)}


def _documented_env() -> list[str]:
    names = []
    for row in _table_rows(_page("reference/environment.md")):
        name = _ticked(row[0])
        assert name is not None, f"environment.md: first cell of {row} is not a `VARIABLE`"
        names.append(name)
    return names


def test_environment_table_has_unique_rows():
    names = _documented_env()
    assert names, "environment.md has no table"
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_hf_zero3_variable_is_documented():
    documented = set(_documented_env())
    wanted = (_source_env_names() - NOT_ENV) | _memory_plan_env_names()
    assert not wanted - documented, f"HF_ZERO3_* variables missing from environment.md: {sorted(wanted - documented)}"


def test_every_documented_variable_is_read_by_the_code():
    sources = "\n".join(f.read_text(encoding="utf-8") for f in _sources())
    known = _source_env_names() | _memory_plan_env_names()
    stray = [n for n in _documented_env() if n not in known and not re.search(rf"\b{re.escape(n)}\b", sources)]
    assert not stray, f"environment.md documents variables the code never names: {stray}"


def test_other_variables_the_package_reads_are_documented():
    """``os.environ.get("X")`` / ``os.getenv("X")`` reads outside ``hf_zero3.testing`` (which only
    sets up its own rank processes)."""
    reads = set()
    for f in _sources():
        if "testing" in f.relative_to(ROOT).parts:
            continue
        for m in _ENV_READ.finditer(f.read_text(encoding="utf-8")):
            reads.add(m.group(1) or m.group(2))
    missing = reads - set(_documented_env())
    assert not missing, f"variables read by the package but missing from environment.md: {sorted(missing)}"


def test_non_variables_are_explained_not_tabled():
    text = _page("reference/environment.md")
    documented = set(_documented_env())
    for name in NOT_ENV:
        assert name in _source_env_names(), f"{name} no longer appears in the sources: drop it from NOT_ENV"
        assert name not in documented, f"{name} is not an environment variable; explain it below the table"
        assert name in text, f"environment.md should say that {name} is not an environment variable"


# -- (b) API reference --------------------------------------------------------------------------

PUBLIC_MODULES = (
    "hf_zero3",
    "hf_zero3.trl",
    "hf_zero3.accelerate",
    "hf_zero3.compile",
    "hf_zero3.generation",
    "hf_zero3.decode",
    "hf_zero3.errors",
    "hf_zero3.testing",
)


def test_only_the_public_modules_define_all():
    """An ``__all__`` marks a public module (the architecture page's rule): every other module
    offers its unprefixed names to the package, and nothing more is public."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    defining = set()
    for path in (root / "hf_zero3").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                parts = path.relative_to(root).with_suffix("").parts
                defining.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    outside = sorted(defining - set(PUBLIC_MODULES))
    assert defining == set(PUBLIC_MODULES), f"__all__ outside the public modules: {outside}"


def _api_entries() -> list[str]:
    return re.findall(r"^:::\s+(\S+)\s*$", _page("reference/api.md"), re.M)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_an_api_entry(module):
    mod = importlib.import_module(module)
    entries = _api_entries()
    by_name: dict[str, list[str]] = {}
    for e in entries:
        by_name.setdefault(e.rsplit(".", 1)[-1], []).append(e)
    missing, wrong = [], []
    for name in mod.__all__:
        if name == "__version__":
            continue
        if name not in by_name:
            missing.append(name)
            continue
        target = getattr(mod, name)
        if not any(_resolve(e) is target for e in by_name[name]):
            wrong.append(f"{name}: {by_name[name]} is not {module}.{name}")
    assert not missing, f"api.md has no '::: ...{'|'.join(missing)}' entry for {module}: {missing}"
    assert not wrong, wrong


def test_api_entries_resolve_and_are_unique():
    entries = _api_entries()
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)
    for e in entries:
        _resolve(e)  # raises for a stale path


# -- (c) options --------------------------------------------------------------------------------


def _option_rows(section: str) -> dict[str, list[str]]:
    sections = _sections(_page("reference/options.md"))
    assert section in sections, f"options.md has no '## `{section}`' section (has {sorted(sections)})"
    rows = {}
    for row in _table_rows(sections[section]):
        name = _ticked(row[0])
        if name is not None:
            rows[name] = row
    return rows


def _py_default(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _check_rows(section: str, names_defaults: dict, default_column: int | None) -> None:
    rows = _option_rows(section)
    missing = [n for n in names_defaults if n not in rows]
    assert not missing, f"options.md section {section!r} lacks rows for {missing}"
    if default_column is None:
        return
    bad = [
        (n, rows[n][default_column], _py_default(d))
        for n, d in names_defaults.items()
        if d is not inspect.Parameter.empty and _ticked(rows[n][default_column]) != _py_default(d)
    ]
    assert not bad, f"options.md section {section!r}: (name, documented default, code default): {bad}"


def test_zero3safe_keywords():
    from hf_zero3.trainer.callback import Zero3Safe

    params = {
        n: p.default
        for n, p in inspect.signature(Zero3Safe.__init__).parameters.items()
        if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD  # LockstepConfig's fields, documented there
    }
    _check_rows("Zero3Safe", params, default_column=2)


def test_lockstep_config_fields():
    from hf_zero3.generation import LockstepConfig

    _check_rows("LockstepConfig", {f.name: f.default for f in dataclasses.fields(LockstepConfig)}, default_column=2)


def test_memory_plan_config_fields():
    from hf_zero3.compile.config import MemoryPlanConfig, _env_name

    fields = {f.name: f.default for f in dataclasses.fields(MemoryPlanConfig)}
    _check_rows("MemoryPlanConfig", fields, default_column=None)
    rows = _option_rows("MemoryPlanConfig")
    bad = [(n, rows[n][3]) for n in fields if _ticked(rows[n][3]) != _env_name(n)]
    assert not bad, f"options.md MemoryPlanConfig env column: {bad}"


def test_zero3_deepspeed_plugin_fields():
    from hf_zero3.accelerate import Zero3DeepSpeedPlugin

    fields = {}
    for f in dataclasses.fields(Zero3DeepSpeedPlugin):
        if not f.init:
            continue
        simple = f.default is not dataclasses.MISSING and isinstance(f.default, (bool, type(None)))
        fields[f.name] = f.default if simple else inspect.Parameter.empty
    _check_rows("Zero3DeepSpeedPlugin", fields, default_column=2)


# -- (d) errors ---------------------------------------------------------------------------------


def _exception_classes(files) -> set[str]:
    """Names of the exception classes defined (``class X(...)``) in ``files``, by their bases."""
    defs = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                defs[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def builtin_exc(name: str) -> bool:
        obj = getattr(builtins, name, None)
        return isinstance(obj, type) and issubclass(obj, BaseException)

    found, grew = set(), True
    while grew:
        grew = False
        for name, bases in defs.items():
            if name not in found and any(builtin_exc(b) or b in found for b in bases):
                found.add(name)
                grew = True
    return found


def _headings(text: str) -> list[str]:
    return [m.group(1).replace("`", "").strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)]


def test_errors_py_classes_are_headings():
    names = _exception_classes([PACKAGE / "errors.py"])
    assert {"RankFailure", "RankDivergenceError", "Zero3Error"} <= names
    headings = _headings(_page("troubleshooting.md"))
    missing = [n for n in sorted(names) if not any(re.search(rf"\b{n}\b", h) for h in headings)]
    assert not missing, f"troubleshooting.md has no heading for {missing}"


def test_every_package_exception_is_a_heading():
    names = _exception_classes(sorted(PACKAGE.rglob("*.py")))
    headings = _headings(_page("troubleshooting.md"))
    missing = [n for n in sorted(names) if not any(re.search(rf"\b{n}\b", h) for h in headings)]
    assert not missing, f"troubleshooting.md has no heading for {missing}"


# -- (e) decode fallback reasons ----------------------------------------------------------------

#: (file, functions) whose returned / assigned reason strings users see in hf_zero3_last_generate
REASON_SOURCES = (
    ("decode/plan.py", ("_step_reason", "region_reason", "plan")),
    ("decode/eligibility.py", ("unsupported",)),
    ("decode/loop.py", ("step",)),
    ("decode/prefill.py", ("run_prefill",)),
    ("decode/logits_processors.py", ("unsupported",)),
)
_REASON_TARGETS = {"reason", "why", "step_why"}


def _strings(node) -> list[ast.AST]:
    if isinstance(node, ast.Tuple):
        return [e for e in node.elts if isinstance(e, (ast.Constant, ast.JoinedStr))]
    return [node] if isinstance(node, (ast.Constant, ast.JoinedStr)) else []


def _reason_nodes(func: ast.AST) -> list[ast.AST]:
    out = []
    for node in ast.walk(func):
        if isinstance(node, ast.Return) and node.value is not None:
            out += _strings(node.value)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in _REASON_TARGETS:
                    out += _strings(node.value)
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts):
                        if isinstance(t, ast.Name) and t.id in _REASON_TARGETS:
                            out += _strings(v)
    return out


def _longest_piece(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    pieces = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return max(pieces, key=len, default="")


def test_decode_fallback_reasons_are_listed():
    page = _page("concepts/fast-decode.md")
    checked, missing = 0, []
    for rel, names in REASON_SOURCES:
        tree = ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))
        funcs = [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names
        ]
        assert {f.name for f in funcs} == set(names), f"{rel}: functions {names} not all found"
        for func in funcs:
            for node in _reason_nodes(func):
                piece = _longest_piece(node).strip()
                if len(piece) < 6:
                    continue
                checked += 1
                if piece not in page:
                    missing.append(f"{rel}:{node.lineno}: {piece!r}")
    assert checked >= 20, f"only {checked} reason strings found: the reason sources moved?"
    assert not missing, "fast-decode.md does not list these fallback reasons:\n" + "\n".join(missing)
