"""Version floors that are true, and the releases hf_zero3 is tested against.

``MINIMUM`` holds, per feature, the oldest release the code works with: the eval fix reads
``DeepSpeedEngine.is_deepcompile_active`` (DeepSpeed 0.19.3), the memory plan registers a pass with a
``PassContract`` (``deepspeed.compile.passes.contract``, checked against 0.19.8). :func:`require` is
called at every public entry point and raises once, naming the package, the installed release and
the fix.
"""

from __future__ import annotations

import functools

#: The releases hf_zero3 is tested against (README "Supported versions").
TESTED = {
    "torch": "2.13.0 (CPU, CI); 2.11 (CUDA 13, GPU runs)",
    "deepspeed": "0.19.8",
    "transformers": "5.23.0",
    "accelerate": "1.15.0",
    "trl": "1.16.0",
    "peft": "0.21.2",
}

#: feature -> {package: oldest release}; "core" applies to every entry point.
MINIMUM = {
    "core": {"torch": "2.6.0", "deepspeed": "0.19.3", "transformers": "5.0.0", "accelerate": "1.10.0"},
    "memory_plan": {"deepspeed": "0.19.8"},
    "trl": {"trl": "1.0.0"},
}


class VersionError(RuntimeError):
    """An installed library is older than the feature needs (the message names the fix)."""


def _installed(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def check_versions(feature: str = "core") -> list[str]:
    """Problems with the installed versions for ``feature``, as messages naming the fix."""
    from packaging.version import Version

    problems = []
    floors = dict(MINIMUM["core"])
    floors.update(MINIMUM.get(feature, {}))
    for pkg, low in floors.items():
        have = _installed(pkg)
        if have is None:
            problems.append(f"{pkg} is not installed; pip install '{pkg}>={low}'")
        elif Version(have.split("+")[0]) < Version(low):
            what = "hf_zero3" if feature == "core" else f"hf_zero3's {feature.replace('_', ' ')}"
            problems.append(
                f"{what} needs {pkg}>={low} but {pkg} {have} is installed; "
                f"pip install -U '{pkg}>={low}' (tested: {TESTED.get(pkg, low)})"
            )
    return problems


@functools.lru_cache(maxsize=None)
def require(feature: str = "core") -> None:
    """Raise :class:`VersionError` when an installed library is below ``feature``'s floor (checked
    once per process per feature)."""
    problems = check_versions(feature)
    if problems:
        raise VersionError("; ".join(problems))
