"""The memory plan's settings: one dataclass, read from the DeepSpeed config or the environment.

In a DeepSpeed config (JSON, or the file an accelerate YAML points to) the settings live under a
top-level key DeepSpeed ignores::

    "hf_zero3": {"memory_plan": {"mode": "budget", "max_memory": "15GiB"}}

Each field has an environment variable of the same name, upper-cased, prefixed ``HF_ZERO3_``
(``HF_ZERO3_MODE=match_zero3``); the config wins over the environment, the environment over the
default. ``"auto"`` means "the default" for every field, so accelerate never sees one it does not
know.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

from ..options import ENVIRONMENT, parse_switch

SECTION = ("hf_zero3", "memory_plan")
MODES = ("budget", "match_zero3")
#: HF_ZERO3_* variables that are not memory-plan fields (so a typo among the rest is caught): the
#: package's one registry, decode switches included.
OTHER_ENV = tuple(ENVIRONMENT)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
MIN_MEMORY = 1 << 20  # below 1 MiB a "memory limit" is a mistake (e.g. "0.5" meant as a fraction)


class ConfigError(ValueError):
    """A memory-plan setting that cannot be used; the message names the key and the accepted forms."""


def parse_bytes(value: Any, name: str = "max_memory", minimum: int = MIN_MEMORY) -> int | None:
    """``15GiB``, ``"16e9"``, ``16000000000`` -> bytes; None / "auto" -> None. Whole bytes only."""
    forms = "write a size such as 15GiB, 16GB or a whole number of bytes (or auto)"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none")):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size; {forms}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        m = _SIZE.fullmatch(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{name}={value!r} is not a size; {forms}")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value!r} is not a finite size; {forms}")
    if number <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}; {forms}")
    if number != int(number):
        raise ConfigError(
            f"{name}={value!r} is {number} bytes, not a whole number (a fraction of the card is not accepted); {forms}"
        )
    if number < minimum:
        raise ConfigError(f"{name}={value!r} is only {int(number)} bytes, below the {minimum}-byte minimum; {forms}")
    return int(number)


def _bool(value: Any, name: str) -> bool:
    """The package's one switch grammar (:func:`hf_zero3.options.parse_switch`), as a ConfigError."""
    if isinstance(value, bool):
        return value
    try:
        return parse_switch(name, str(value))
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a boolean; use true or false") from None


def _choice(choices: tuple) -> Callable[[Any, str], str]:
    def parse(value: Any, name: str) -> str:
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {choices}")
        return value

    return parse


def _margin(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number; use a fraction in [0, 0.5), e.g. 0.02") from None
    if not (math.isfinite(number) and 0 <= number < 0.5):
        raise ConfigError(f"{name}={value!r} must be in [0, 0.5)")
    return number


def _step(value: Any, name: str) -> int:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number != int(number):
        raise ConfigError(f"{name}={value!r} is not a whole number of steps")
    if number < 0:
        raise ConfigError(f"{name}={value!r} must be >= 0")
    return int(number)


def _fuse(value: Any, name: str) -> int:
    return parse_bytes(value, name, minimum=1) or (1 << 30)


def _backend(value: Any, name: str) -> str:
    if value not in ("inductor", "eager"):
        raise ConfigError(f"{name}={value!r}: DeepCompile supports inductor or eager")
    return value


@dataclass
class MemoryPlanConfig:
    """Settings of hf_zero3's DeepCompile memory plan (env: ``HF_ZERO3_<FIELD>``)."""

    enabled: bool = field(
        default=True,
        metadata={"help": "replace DeepSpeed's prefetch + selective_gather with the budgeted plan", "parse": _bool},
    )
    mode: str = field(
        default="budget",
        metadata={
            "help": "budget: fill the budget with prefetches and persistent parameters by benefit per byte; "
            "match_zero3: never plan above what the gather/release graph alone peaks at",
            "parse": _choice(MODES),
        },
    )
    max_memory: int | None = field(
        default=None,
        metadata={
            "help": "per-process limit in bytes (or '15GiB'); default: card total x per-process memory fraction",
            "parse": parse_bytes,
        },
    )
    safety_margin: float = field(default=0.02, metadata={"help": "fraction of the limit kept free", "parse": _margin})
    persist: bool = field(
        default=True, metadata={"help": "also keep the best parameters gathered (budget mode)", "parse": _bool}
    )
    gate: bool = field(
        default=True,
        metadata={"help": "run-time gate: defer a prefetch the agreed headroom cannot hold", "parse": _bool},
    )
    plan_step: int = field(
        default=0,
        metadata={
            "help": "global step whose compile applies the plan; 0 = a single compile, profiled before the "
            "optimizer's states exist (their size is reserved); DeepSpeed's default uses 5",
            "parse": _step,
        },
    )
    calibrate_steps: int = field(
        default=2,
        metadata={
            "help": "training steps after a compile measured before the plan goes past match_zero3's level: their "
            "real peak (agreed) sets how far the gate may prefetch and what may stay persistent; 0 = trust "
            "the profile (persistence chosen at compile time)",
            "parse": _step,
        },
    )
    max_fuse_bytes: int = field(default=1 << 30, metadata={"help": "largest fused prefetch, bytes", "parse": _fuse})
    coalesce: bool = field(
        default=True,
        metadata={
            "help": "merge consecutive prefetches into one earlier fused all-gather while the budget holds "
            "(fewer collective launches per graph)",
            "parse": _bool,
        },
    )
    compile_backend: str = field(
        default="inductor",
        metadata={
            "help": "backend for engine.compile when accelerate did not call it (DeepSpeed launcher)",
            "parse": _backend,
        },
    )

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, f.metadata["parse"](getattr(self, f.name), f.name))

    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        where: str = "hf_zero3.memory_plan",
    ):
        """Config values over ``HF_ZERO3_*`` environment variables over defaults; "auto" = default.
        Every bad value is named by its key (``where``.key) or its environment variable."""
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where} must be a mapping of settings, got {type(values).__name__} {values!r}")
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown {where} key(s) {unknown}; known keys: {sorted(known)}")
        _check_env_names(env, known)
        kwargs = {}
        for name, f in known.items():
            v, label = values.get(name, MISSING), f"{where}.{name}"
            if v is MISSING or _is_auto(v):
                v, label = env.get(_env_name(name), MISSING), _env_name(name)
            if v is not MISSING and not _is_auto(v):
                kwargs[name] = f.metadata["parse"](v, label)
        return cls(**kwargs)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | None, env=None):
        section = (ds_config or {}).get(SECTION[0])
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"DeepSpeed config key {SECTION[0]!r} must be a mapping, got {type(section).__name__}")
        unknown = sorted(set(section) - {SECTION[1]})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} under {SECTION[0]!r}; expected {SECTION[1]!r}")
        return cls.from_dict(section.get(SECTION[1]), env)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def _env_name(field_name: str) -> str:
    return f"HF_ZERO3_{field_name.upper()}"


def _check_env_names(env: Mapping[str, str], known) -> None:
    """An ``HF_ZERO3_*`` variable that names no setting is a typo: say which one was meant."""
    names = [_env_name(n) for n in known] + list(OTHER_ENV)
    for var in env:
        if var.startswith("HF_ZERO3_") and var not in names:
            close = difflib.get_close_matches(var, names, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {sorted(names)}"
            raise ConfigError(f"environment variable {var} is not an hf_zero3 setting; {hint}")
