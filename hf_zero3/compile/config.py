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

import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping

__all__ = ["MemoryPlanConfig", "ConfigError", "parse_bytes", "SECTION"]

SECTION = ("hf_zero3", "memory_plan")
MODES = ("budget", "match_zero3")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """A memory-plan setting that cannot be used; the message names the fix."""


def parse_bytes(value: Any, name: str = "max_memory") -> int | None:
    """``15GiB``, ``"16e9"``, ``16000000000`` -> bytes; None / "auto" -> None."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size; write e.g. 15GiB, 16GB or a number of bytes")
    return parse_bytes(float(m.group(1)) * _UNITS[m.group(2).lower()], name)


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use true or false")


@dataclass
class MemoryPlanConfig:
    """Settings of hf_zero3's DeepCompile memory plan (env: ``HF_ZERO3_<FIELD>``)."""

    enabled: bool = field(default=True, metadata={"help": "replace DeepSpeed's prefetch + selective_gather "
                                                          "with the budgeted plan"})
    mode: str = field(default="budget", metadata={
        "help": "budget: fill the budget with prefetches and persistent parameters by benefit per byte; "
                "match_zero3: never plan above what the gather/release graph alone peaks at"})
    max_memory: int | None = field(default=None, metadata={
        "help": "per-process limit in bytes (or '15GiB'); default: card total x per-process memory fraction"})
    safety_margin: float = field(default=0.02, metadata={"help": "fraction of the limit kept free"})
    persist: bool = field(default=True, metadata={"help": "also keep the best parameters gathered (budget mode)"})
    gate: bool = field(default=True, metadata={"help": "run-time gate: defer a prefetch the agreed headroom "
                                                       "cannot hold"})
    plan_step: int = field(default=0, metadata={
        "help": "global step whose compile applies the plan; 0 = a single compile, profiled before the "
                "optimizer's states exist (their size is reserved); DeepSpeed's default uses 5"})
    max_fuse_bytes: int = field(default=1 << 30, metadata={"help": "largest fused prefetch, bytes"})
    coalesce: bool = field(default=True, metadata={
        "help": "merge consecutive prefetches into one earlier fused all-gather while the budget holds "
                "(fewer collective launches per graph)"})
    compile_backend: str = field(default="inductor", metadata={
        "help": "backend for engine.compile when accelerate did not call it (DeepSpeed launcher)"})

    def __post_init__(self):
        self.enabled = _bool(self.enabled, "enabled")
        self.persist = _bool(self.persist, "persist")
        self.gate = _bool(self.gate, "gate")
        self.coalesce = _bool(self.coalesce, "coalesce")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {MODES}")
        self.max_memory = parse_bytes(self.max_memory)
        try:
            self.safety_margin = float(self.safety_margin)
            self.plan_step = int(self.plan_step)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"safety_margin must be a number and plan_step an integer ({exc})") from None
        if not 0 <= self.safety_margin < 0.5:
            raise ConfigError(f"safety_margin={self.safety_margin} must be in [0, 0.5)")
        if self.plan_step < 0:
            raise ConfigError(f"plan_step={self.plan_step} must be >= 0")
        self.max_fuse_bytes = parse_bytes(self.max_fuse_bytes, "max_fuse_bytes") or (1 << 30)
        if self.compile_backend not in ("inductor", "eager"):
            raise ConfigError(f"compile_backend={self.compile_backend!r}: DeepCompile supports inductor or eager")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        """Config values over ``HF_ZERO3_*`` environment variables over defaults; "auto" = default."""
        values = dict(values or {})
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown hf_zero3.memory_plan key(s) {unknown}; known keys: {sorted(known)}")
        kwargs = {}
        for name, f in known.items():
            v = values.get(name, MISSING)
            if v is MISSING or (isinstance(v, str) and v.strip().lower() == "auto"):
                v = env.get(f"HF_ZERO3_{name.upper()}", MISSING)
            if v is not MISSING and not (isinstance(v, str) and v.strip().lower() == "auto"):
                kwargs[name] = v
        return cls(**kwargs)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | None, env=None):
        section = (ds_config or {}).get(SECTION[0]) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"DeepSpeed config key {SECTION[0]!r} must be a mapping, got {type(section).__name__}")
        unknown = sorted(set(section) - {SECTION[1]})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} under {SECTION[0]!r}; expected {SECTION[1]!r}")
        return cls.from_dict(section.get(SECTION[1]), env)

    def to_dict(self) -> dict:
        return asdict(self)
