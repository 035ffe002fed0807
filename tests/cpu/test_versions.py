"""The releases hf_zero3 declares are the ones CI tests: ``_upstream.versions``' release sets equal
the requirements files CI installs, pyproject's floors equal the floor set, and the supported-versions
tables of README and the docs list exactly those sets. A transformers newer than the newest checked
makes every function the fast decode path replaces fall back, with a reason naming the release."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_zero3._upstream import transformers as hf_up
from hf_zero3._upstream import versions

ROOT = Path(__file__).resolve().parents[2]
FILES = {"floor": "floor.txt", "pinned": "tested.txt", "newest": "newest.txt"}
PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "trl", "peft")


def _pins(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_release_set_is_the_requirements_file_ci_installs(name):
    pins = _pins(ROOT / "requirements" / FILES[name])
    assert {p: pins[p] for p in PACKAGES} == versions.RELEASE_SETS[name]
    assert set(versions.RELEASE_SETS[name]) == set(PACKAGES)


def test_ci_runs_every_release_set():
    """.ci/run installs and tests each set: the README's make test (pinned), test-newest and test-floor."""
    ci = (ROOT / ".ci" / "run").read_text()
    make = (ROOT / "Makefile").read_text()
    for target in ("make test\n", "make test-newest\n", "make test-floor\n"):
        assert target in ci, target
    assert "CONSTRAINTS ?= requirements/tested.txt" in make
    assert "CONSTRAINTS=requirements/newest.txt" in make and "CONSTRAINTS=requirements/floor.txt" in make


def test_pyproject_floors_are_the_floor_set():
    text = (ROOT / "pyproject.toml").read_text()
    declared = {
        m.group(1): m.group(2)
        for m in re.finditer(r'"(torch|deepspeed|transformers|accelerate|trl|peft)>=([\d.]+)', text)
    }
    floors = {k: v for d in versions.MINIMUM.values() for k, v in d.items()}
    assert set(declared) == set(PACKAGES)
    for pkg, low in declared.items():
        assert _same_release(low, floors[pkg]), (pkg, low, floors[pkg])
        if pkg == "torch":  # CI's CPU torch is the newest with a CPU build; the GPU runs take the floor
            assert floors[pkg] == versions.GPU_TORCH
        else:
            assert _same_release(low, versions.RELEASE_SETS["floor"][pkg]), pkg


def _same_release(a: str, b: str) -> bool:
    from packaging.version import Version

    return Version(a) == Version(b)


def _table(path: Path) -> dict:
    """``| set | torch | deepspeed | ... |`` rows of a supported-versions table, by set name."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells and cells[0].split(" ")[0] in FILES and len(cells) == 1 + len(PACKAGES):
            rows[cells[0].split(" ")[0]] = dict(zip(PACKAGES, cells[1:]))
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/troubleshooting.md"])
def test_the_supported_versions_table_is_the_release_sets(page):
    assert _table(ROOT / page) == versions.RELEASE_SETS, page


def test_a_newer_transformers_makes_every_replaced_function_fall_back_naming_it(monkeypatch, newer_transformers):
    """Never run old math on a release nobody checked: each fenced function (the family kernels'
    and the static loop's logits processors) falls back, and the reason names the release."""
    from hf_zero3.decode import families
    from hf_zero3.testing import models

    assert all(hf_up.unchecked_reason(p) is None for p in hf_up.CHECKED_SOURCES)
    newer_transformers()
    for path in hf_up.CHECKED_SOURCES:
        why = hf_up.unchecked_reason(path)
        assert why is not None and "transformers 5.99.0 is newer" in why and versions.NEWEST["transformers"] in why
    assert families.mlp_forwards() == () and families.rope_forwards() == ()
    model = models.plain_model(models.tiny_llama_config())
    assert any("5.99.0" in r for r in families.fallbacks(model))
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from hf_zero3.decode import logits_processors

    assert "5.99.0" in (logits_processors.unsupported(RepetitionPenaltyLogitsProcessor(1.3)) or "")
    monkeypatch.undo()
    assert families.fallbacks(model) == ()


def test_newer_than_checked_compares_releases():
    newest = versions.NEWEST["transformers"]
    assert versions.newer_than_checked("transformers", newest) is None
    assert versions.newer_than_checked("transformers", "5.0.0") is None
    assert versions.newer_than_checked("transformers", "9.0.0.dev0") == "9.0.0.dev0"
    assert versions.newer_than_checked("torch", "9.0.0+cpu") == "9.0.0+cpu"
    assert versions.newer_than_checked("no-such-package") is None
