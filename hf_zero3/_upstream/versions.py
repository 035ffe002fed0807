"""The releases hf_zero3 is tested against, and the floors it declares.

CI runs three release sets (``RELEASE_SETS``, each a ``requirements/<name>.txt`` of pip constraints):
the whole suite on ``pinned`` (``make test``, the README's command) and on ``newest`` (the newest
releases on PyPI, ``make test-newest``), and the contract tests with one Trainer, one lockstep and
one TRL case on ``floor`` (``make test-floor``). ``MINIMUM`` is the floor set as declared in
``pyproject.toml`` and checked at every entry point (:func:`require`); torch's floor is the GPU
host's release, where the GPU tests run (CI's CPU torch is the newest with a CPU build). A test holds
this module, the requirements files, ``pyproject.toml`` and the README's table to each other.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

#: CI's release sets (requirements/<name>.txt); README "Supported versions" lists them.
RELEASE_SETS = {
    "floor": {
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "transformers": "5.17.0",
        "accelerate": "1.15.0",
        "trl": "1.16.0",
        "peft": "0.21.2",
    },
    "pinned": {
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "transformers": "5.23.0",
        "accelerate": "1.15.0",
        "trl": "1.16.0",
        "peft": "0.21.2",
    },
    "newest": {
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "transformers": "5.25.0",
        "accelerate": "1.16.0",
        "trl": "1.16.0",
        "peft": "0.21.2",
    },
}
#: The release the GPU tests and benchmarks run torch at (CUDA 13 build).
GPU_TORCH = "2.11.0"

#: The newest release of each library hf_zero3 was checked against: a newer transformers makes
#: every function the fast decode path replaces fall back to the model's own code, with a reason
#: naming the release (``_upstream.transformers.unchecked_reason``).
NEWEST = RELEASE_SETS["newest"]

#: feature -> {package: oldest release}; "core" applies to every entry point (pyproject's floors).
MINIMUM = {
    "core": {"torch": GPU_TORCH, "deepspeed": "0.19.8", "transformers": "5.17.0", "accelerate": "1.15.0"},
    "trl": {"trl": "1.16.0"},
    "peft": {"peft": "0.21.2"},
}

#: The releases hf_zero3 is tested against, for messages (README "Supported versions").
TESTED = {pkg: ", ".join(dict.fromkeys(s[pkg] for s in RELEASE_SETS.values())) for pkg in RELEASE_SETS["pinned"]}
TESTED["torch"] = f"{TESTED['torch']} (CPU, CI); {GPU_TORCH} (CUDA 13, GPU runs)"


class VersionError(RuntimeError):
    """An installed library is older than the feature needs (the message names the fix)."""


@functools.lru_cache(maxsize=None)
def installed(pkg: str) -> str | None:
    """The installed release of ``pkg`` (None: not installed; read once per process: the decode
    path asks at every call)."""
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def check_versions(feature: str = "core") -> list[str]:
    """Problems with the installed versions for ``feature``, as messages naming the fix."""
    problems = []
    floors = dict(MINIMUM["core"])
    floors.update(MINIMUM.get(feature, {}))
    for pkg, low in floors.items():
        have = installed(pkg)
        if have is None:
            problems.append(f"{pkg} is not installed; pip install '{pkg}>={low}'")
        elif Version(have.split("+")[0]) < Version(low):
            what = "hf_zero3" if feature == "core" else f"hf_zero3's {feature.replace('_', ' ')}"
            problems.append(
                f"{what} needs {pkg}>={low} but {pkg} {have} is installed; "
                f"pip install -U '{pkg}>={low}' (tested: {TESTED.get(pkg, low)})"
            )
    return problems


def newer_than_checked(pkg: str, have: str | None = None) -> str | None:
    """``pkg``'s installed release (or ``have``) where it is newer than :data:`NEWEST`'s (None: not
    newer, or not installed)."""
    have = have if have is not None else installed(pkg)
    if have is None or pkg not in NEWEST:
        return None
    return have if Version(have.split("+")[0]) > Version(NEWEST[pkg]) else None


@functools.lru_cache(maxsize=None)
def require(feature: str = "core") -> None:
    """Raise :class:`VersionError` when an installed library is below ``feature``'s floor (checked
    once per process per feature)."""
    problems = check_versions(feature)
    if problems:
        raise VersionError("; ".join(problems))
