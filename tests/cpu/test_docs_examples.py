"""Every fenced code block in README.md and docs/**/*.md is run, checked, or marked GPU-only.

The line before each fenced block (blank lines allowed between) is one HTML comment:

* ``<!-- example: ranks=N -->``: a python block run on N gloo ranks (N = 1 or 2) through
  ``run_ranks(..., init="deepspeed")`` on CPU, in a fresh temporary working directory holding
  ``ds_config.json``, with ``model``, ``tokenizer``, ``train_dataset``, ``eval_dataset`` and
  ``ds_config`` predefined (:mod:`fixtures.docs_fixtures`); it must finish on every rank.
* ``<!-- example: shell -->``: every command is a ``make`` target of the Makefile (what ``.ci/run``
  and a user run) or a ``pip install`` of what the Makefile / pyproject.toml install.
* ``<!-- example: config -->``: a YAML/JSON block, parsed and built as a user's run would: an
  accelerate config file -> accelerate's ``ClusterConfig`` and ``Zero3DeepSpeedPlugin`` from the
  DeepSpeed file it names; a DeepSpeed config (or fragment) -> ``MemoryPlanConfig.from_ds_config``
  (and the plugin, for a whole config). A block whose paragraph says "This is `examples/...`"
  must equal that file.
* ``<!-- example: output -->``: a text block of ``hf_zero3 env``'s output (with ``--model`` of a
  small Llama config): its parts and row names are the ones the command prints here.
* ``<!-- gpu-only -->``: not run; the paragraph right before it must say "GPU only".

A block whose code is identical to one already run (a README quick start repeated in its guide)
is not run twice. Also checked: the README's size, its relative links, and that mkdocs.yml's nav
lists every page under docs/.
"""

from __future__ import annotations

import json
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 12_000

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*(?:example:\s*(?P<kind>ranks=(?P<n>\d+)|shell|config|output)|(?P<gpu>gpu-only))\s*-->$")
_PY, _SHELL, _CONFIG = {"python", "py"}, {"bash", "sh", "shell", "console"}, {"yaml", "yml", "json"}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "ranks=N", "shell", "config", "output", "gpu-only" or None
    paragraph: str  # the text paragraph right before the marker (or the block)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    return files + sorted((ROOT / "docs").rglob("*.md"))


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = str(path.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        lang = (m.group("info").split() or [""])[0].lower().lstrip(".{").rstrip("}")
        start, body, i = i, [], i + 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close.group("fence")[0] == fence[0]
                and len(close.group("fence")) >= len(fence)
                and not close.group("info").strip()
            ):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker, k = None, j
        mk = _MARKER.match(lines[j].strip()) if j >= 0 else None
        if mk:
            marker = mk.group("kind") or "gpu-only"
            k = j - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
        para = []
        while k >= 0 and lines[k].strip() and not _FENCE.match(lines[k]):
            para.append(lines[k])
            k -= 1
        blocks.append(Block(rel, start + 1, lang, "\n".join(body) + "\n", marker, "\n".join(reversed(para))))
    return blocks


BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]


# -- ranks ---------------------------------------------------------------------------------------
_RAN: dict[tuple[str, int], list] = {}


def _run_ranks_block(block: Block, n: int) -> None:
    from fixtures.docs_fixtures import run_example, write_ds_config

    from hf_zero3.testing import run_ranks

    assert block.lang in _PY, f"a ranks example must be a python block, not {block.lang!r}"
    assert n in (1, 2), f"ranks={n}: examples run on 1 or 2 ranks"
    compile(block.code, block.id, "exec")  # a syntax error fails here, before any rank starts
    key = (block.code, n)
    if key not in _RAN:
        with tempfile.TemporaryDirectory(prefix="hf_zero3_docs_") as workdir:
            write_ds_config(workdir)
            code = "\n" * (block.line) + block.code  # tracebacks name the Markdown file's own lines
            _RAN[key] = run_ranks(
                run_example,
                n,
                args=(code, str(ROOT / block.path), workdir),
                init="deepspeed",
                timeout=240,
                pg_timeout=60,
            )
    results = _RAN[key]
    assert sorted(r["rank"] for r in results) == list(range(n)) and all(r["ran"] for r in results)


# -- shell ---------------------------------------------------------------------------------------
def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)[ \t]*:(?!=)", text, re.M)} - {".PHONY"}


def _extras() -> set[str]:
    """The optional-dependency groups of pyproject.toml (``pip install ".[name]"``)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", pyproject, re.M | re.S)
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section.group(1), re.M)) if section else set()


def _commands(code: str) -> list[list[str]]:
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value cmd
            words = words[1:]
        if words:
            out.append(words)
    return out


def _check_pip_install(args: list[str]) -> None:
    installed_by_make = (ROOT / "Makefile").read_text() + (ROOT / "requirements" / "tested.txt").read_text()
    for arg in args:
        if arg.startswith("-"):
            continue
        m = re.fullmatch(r"\.(?:\[(?P<extras>[^\]]*)\])?", arg)
        if m:
            unknown = {e.strip() for e in (m.group("extras") or "").split(",") if e.strip()} - _extras()
            assert not unknown, f"pip install {arg}: no such extra {sorted(unknown)} in pyproject.toml"
            continue
        name = re.split(r"[<>=!~\[; ]", arg)[0]
        assert re.search(rf"(?<![A-Za-z0-9_-]){re.escape(name)}(?![A-Za-z0-9_-])", installed_by_make), (
            f"pip install {arg}: the Makefile's install does not install {name}"
        )


def _check_shell(block: Block) -> None:
    assert block.lang in _SHELL, f"a shell example must be a bash/sh block, not {block.lang!r}"
    commands = _commands(block.code)
    assert commands, "an empty shell example"
    targets = _make_targets()
    for words in commands:
        cmd = Path(words[0]).name
        if cmd == "make":
            goals = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            assert goals, "bare `make`: name the target"
            missing = [g for g in goals if g not in targets]
            assert not missing, f"`{' '.join(words)}`: the Makefile has no target {missing}"
        elif cmd in ("pip", "pip3") and words[1:2] == ["install"]:
            _check_pip_install(words[2:])
        elif cmd.startswith("python") and words[1:4] == ["-m", "pip", "install"]:
            _check_pip_install(words[4:])
        else:
            pytest.fail(
                f"`{' '.join(words)}`: a shell example may run only Makefile targets and pip installs "
                "(anything else: say it in the text, or make it a python example)"
            )


# -- config --------------------------------------------------------------------------------------
def _load(block: Block):
    if block.lang == "json":
        return json.loads(block.code)
    import yaml

    return yaml.safe_load(block.code)


def _check_accelerate_yaml(block: Block, config: dict) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    import hf_zero3
    from hf_zero3.compile import MemoryPlanConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "accelerate.yaml"
        path.write_text(block.code)
        cluster = ClusterConfig.from_yaml_file(str(path))  # what `accelerate launch --config_file` reads
    ds = cluster.deepspeed_config or {}
    assert str(cluster.distributed_type.value) == "DEEPSPEED", "an accelerate example should use DeepSpeed"
    ds_file = ds.get("deepspeed_config_file")
    with hf_zero3.patching():
        if ds_file:
            file = ROOT / ds_file
            assert file.is_file(), f"deepspeed_config_file {ds_file!r} is not a file of the repository"
            plugin = hf_zero3.Zero3DeepSpeedPlugin(hf_ds_config=str(file), zero3_init_flag=ds.get("zero3_init_flag"))
        else:
            plugin = hf_zero3.Zero3DeepSpeedPlugin(
                zero_stage=ds.get("zero_stage"), zero3_init_flag=ds.get("zero3_init_flag")
            )
    MemoryPlanConfig.from_ds_config(plugin.deepspeed_config, env={})


def _check_config(block: Block) -> None:
    assert block.lang in _CONFIG, f"a config example must be a yaml/json block, not {block.lang!r}"
    config = _load(block)
    assert isinstance(config, dict) and config, "a config example must be a non-empty mapping"
    shown = re.search(r"[Tt]his is `(examples/[^`]+)`", block.paragraph)
    if shown:  # "This is `examples/x.json`": the block is that file (comments aside)
        file = ROOT / shown.group(1)
        assert file.is_file(), f"{shown.group(1)} does not exist"
        text = file.read_text()
        import yaml

        assert (json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)) == config, (
            f"the block differs from {shown.group(1)}"
        )
    import hf_zero3
    from hf_zero3.compile import MemoryPlanConfig

    if "distributed_type" in config or "compute_environment" in config:
        _check_accelerate_yaml(block, config)
        return
    known = {"zero_optimization", "compile", "hf_zero3"}
    assert known & set(config), (
        f"config example with keys {sorted(config)}: expected an accelerate config "
        f"file or a DeepSpeed config (one of {sorted(known)})"
    )
    MemoryPlanConfig.from_ds_config(config, env={})  # our section: unknown keys, bad values raise
    if "zero_optimization" in config:
        with hf_zero3.patching():
            plugin = hf_zero3.Zero3DeepSpeedPlugin(hf_ds_config=config)
        assert plugin.deepspeed_config["zero_optimization"]["stage"] in (0, 1, 2, 3, "auto")


# -- the parametrized test -----------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block):
    if block.marker is None:
        pytest.fail(
            f"{block.id}: fenced block without a marker comment; put one of <!-- example: ranks=N -->, "
            "<!-- example: shell -->, <!-- example: config -->, <!-- example: output -->, <!-- gpu-only --> "
            "on the line before it"
        )
    if block.marker == "gpu-only":
        assert "GPU only" in block.paragraph, (
            f"{block.id}: <!-- gpu-only --> block whose preceding paragraph does not say 'GPU only'"
        )
    elif block.marker.startswith("ranks="):
        _run_ranks_block(block, int(block.marker.split("=")[1]))
    elif block.marker == "shell":
        _check_shell(block)
    elif block.marker == "output":
        _check_env_output(block)
    else:
        _check_config(block)


def _env_rows(text: str) -> dict:
    """``hf_zero3 env``'s text output as {part title: [row names]}."""
    parts, part = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            part = line.rstrip(":")
            parts[part] = []
        elif line.strip():
            parts[part].append(re.split(r"\s{2,}", line.strip())[0])
    return parts


def _check_env_output(block: Block) -> None:
    from hf_zero3 import env
    from hf_zero3.testing import models

    assert "hf_zero3 env" in block.paragraph, f"{block.id}: an output block names its command"
    with tempfile.TemporaryDirectory() as tmp:
        models.tiny_llama_config().save_pretrained(tmp)
        printed = env.render(env.report(tmp))
    assert _env_rows(block.code) == _env_rows(printed), block.id


def test_docs_have_examples():
    assert any(b.marker and b.marker.startswith("ranks=") for b in BLOCKS)


def _anchors(markdown: str) -> set[str]:
    """Heading ids as Python-Markdown's toc extension makes them (what mkdocs and GitHub link to)."""
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", markdown, re.M):
        slug = re.sub(r"[^\w\s-]", "", re.sub(r"`", "", heading)).strip().lower()
        out.add(re.sub(r"[-\s]+", "-", slug))
    return out


def test_readme_is_short_and_its_links_resolve():
    """The README is not part of the site, so its links are checked here (mkdocs checks the site's)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= README_LIMIT, f"README.md has {len(text)} characters (limit {README_LIMIT})"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        assert file.exists(), f"README.md links to missing {target}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text(encoding="utf-8")), f"README.md links to missing anchor {target}"


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return []


def test_mkdocs_nav_lists_every_page():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages, f"nav {sorted(nav)} vs pages {pages}"
    assert len(set(nav)) == len(nav)
