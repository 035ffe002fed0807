"""Getting the memory plan into ``accelerate launch`` and ``transformers.Trainer`` runs.

accelerate (1.15, since huggingface/accelerate#3069) calls ``engine.compile(backend,
compile_kwargs)`` after ``deepspeed.initialize`` with no ``schedule``, skips the call entirely
under the DeepSpeed launcher (which exports none of the YAML's ``dynamo_config``), and raises on
any ``"auto"`` leaf of the DeepSpeed config it does not fill itself. :func:`enable_memory_plan`
handles all three, once per process, through the two patches in :mod:`hf_zero3._compat`:

* ``Accelerator._prepare_deepspeed`` is wrapped: before it runs, the ``hf_zero3.memory_plan``
  section is validated and its ``"auto"`` values resolved (so accelerate never sees them); after
  it, an engine with ``compile.deepcompile`` that nobody compiled is compiled;
* ``DeepSpeedEngine.compile`` is wrapped: a call without ``schedule`` on a ZeRO-3 DeepCompile
  engine registers the pass and uses :func:`memory_plan_schedule`.

:class:`Zero3DeepSpeedPlugin` is the same thing as an accelerate plugin (``Accelerator(
deepspeed_plugin=Zero3DeepSpeedPlugin(...))``), and ``Zero3Safe`` enables it for the Trainer.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import DeepSpeedPlugin

from hf_zero3.compile.config import SECTION, ConfigError, MemoryPlanConfig

__all__ = ["Zero3DeepSpeedPlugin", "enable_memory_plan", "memory_plan_enabled", "resolve_memory_plan_section"]

log = logging.getLogger("hf_zero3.accelerate")
_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


def resolve_memory_plan_section(ds_config: dict, override: MemoryPlanConfig | None = None) -> MemoryPlanConfig:
    """Validate the ``hf_zero3.memory_plan`` section of ``ds_config`` (in place): unknown keys raise,
    ``"auto"`` and missing values take the environment/defaults, and the resolved values are
    written back so accelerate's "auto" check has nothing to object to."""
    config = override or MemoryPlanConfig.from_ds_config(ds_config)
    if SECTION[0] in ds_config or override is not None:
        ds_config.setdefault(SECTION[0], {})[SECTION[1]] = config.to_dict()
    return config


def _default_schedule(engine):
    """The memory plan's schedule for a ZeRO-3 DeepCompile engine that asks for it, else None."""
    from hf_zero3.compile.memory_plan import apply_memory_plan, engine_plan_config, plan_applies

    config = engine_plan_config(engine)
    if not plan_applies(engine, config):
        return None
    _, schedule = apply_memory_plan(engine, config)
    log.info("hf_zero3: DeepCompile schedule %s", schedule)
    return schedule


def _before_prepare(accelerator) -> MemoryPlanConfig:
    plugin = accelerator.state.deepspeed_plugin
    return resolve_memory_plan_section(plugin.deepspeed_config, getattr(plugin, "_hf_zero3_config", None))


def _after_prepare(accelerator, engine, config: MemoryPlanConfig) -> None:
    from hf_zero3.compile.memory_plan import plan_applies

    engine._hf_zero3_memory_plan_config = config
    if plan_applies(engine, config) and not getattr(engine, "is_compiled", False):
        # The DeepSpeed launcher drops the YAML's dynamo settings, so accelerate compiled nothing.
        log.info("hf_zero3: compiling the DeepCompile engine accelerate left uncompiled (backend=%s)",
                 config.compile_backend)
        engine.compile(backend=config.compile_backend)


def enable_memory_plan() -> None:
    """Install the two wrappers (idempotent, process-wide). The plan itself is then configured per
    run by the DeepSpeed config's ``hf_zero3.memory_plan`` section (or ``HF_ZERO3_*``)."""
    from hf_zero3 import _compat

    with _LOCK:
        if "compile" not in _INSTALLED:
            _INSTALLED["compile"] = _compat.patch_deepspeed_compile_default_schedule(_default_schedule)
        if "prepare" not in _INSTALLED:
            _INSTALLED["prepare"] = _compat.patch_accelerate_prepare_deepspeed(_before_prepare, _after_prepare)


def memory_plan_enabled() -> bool:
    return "compile" in _INSTALLED and "prepare" in _INSTALLED


def disable_memory_plan() -> None:
    """Remove the wrappers (tests)."""
    with _LOCK:
        for key in ("compile", "prepare"):
            if key in _INSTALLED:
                _INSTALLED.pop(key)()


@dataclass
class Zero3DeepSpeedPlugin(DeepSpeedPlugin):
    """accelerate's ``DeepSpeedPlugin`` plus hf_zero3's DeepCompile memory plan.

    ``memory_plan`` (a :class:`MemoryPlanConfig` or a dict of its fields) overrides the DeepSpeed
    config's ``hf_zero3.memory_plan`` section, which overrides ``HF_ZERO3_*``. Everything else is
    accelerate's plugin: ``hf_ds_config`` (or ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` under
    ``accelerate launch``) still names the DeepSpeed config.
    """

    memory_plan: Any = field(default=None, metadata={"help": "MemoryPlanConfig or dict of its fields"})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.memory_plan, MemoryPlanConfig):
            config = self.memory_plan
        elif isinstance(self.memory_plan, dict):
            base = dict((self.deepspeed_config.get(SECTION[0]) or {}).get(SECTION[1]) or {})
            config = MemoryPlanConfig.from_dict({**base, **self.memory_plan})
        elif self.memory_plan is None:
            config = MemoryPlanConfig.from_ds_config(self.deepspeed_config)
        else:
            raise ConfigError(f"memory_plan must be a MemoryPlanConfig or a dict, got {type(self.memory_plan).__name__}")
        self._hf_zero3_config = config
        resolve_memory_plan_section(self.deepspeed_config, config)
        enable_memory_plan()
