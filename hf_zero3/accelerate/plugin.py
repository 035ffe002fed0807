"""Getting the memory plan into ``accelerate launch`` and ``transformers.Trainer`` runs.

accelerate (1.15, since huggingface/accelerate#3069) calls ``engine.compile(backend,
compile_kwargs)`` after ``deepspeed.initialize`` with no ``schedule``, skips the call entirely
under the DeepSpeed launcher (which exports none of the YAML's ``dynamo_config``), and raises on
any ``"auto"`` leaf of the DeepSpeed config it does not fill itself. :func:`enable_memory_plan`
handles all three through the two patches in :mod:`hf_zero3._upstream.accelerate`, installed by
name in :mod:`hf_zero3._upstream.patches` (``hf_zero3.unpatch()`` removes them):

* ``Accelerator._prepare_deepspeed`` is wrapped: before it runs, the ``hf_zero3.memory_plan``
  section is validated and its ``"auto"`` values resolved (so accelerate never sees them); after
  it, the engine's runtime gets the settings, and an engine with ``compile.deepcompile`` that
  nobody compiled is compiled;
* ``DeepSpeedEngine.compile`` is wrapped: a call without ``schedule`` on a ZeRO-3 DeepCompile
  engine registers the plan and uses :func:`memory_plan_schedule`.

They are installed only where the plan is wanted: by :class:`Zero3DeepSpeedPlugin` (whose DeepSpeed
config enables DeepCompile), by ``Zero3Safe`` for a Trainer whose DeepSpeed config enables
DeepCompile ZeRO-3, or by calling :func:`enable_memory_plan`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import DeepSpeedPlugin

from .._upstream import accelerate as acc_up
from .._upstream import patches
from .._upstream.versions import require
from ..compile.config import SECTION, ConfigError, MemoryPlanConfig
from ..compile.memory_plan import apply_memory_plan, bind_memory_plan_config, engine_plan_config, plan_applies

log = logging.getLogger("hf_zero3.accelerate")
PATCHES = (
    "deepspeed.DeepSpeedEngine.compile: default schedule",
    "accelerate.Accelerator._prepare_deepspeed: memory plan",
)


def resolve_memory_plan_section(ds_config: dict, override: MemoryPlanConfig | None = None) -> MemoryPlanConfig:
    """Validate the ``hf_zero3.memory_plan`` section of ``ds_config`` (in place): unknown keys raise,
    ``"auto"`` and missing values take the environment/defaults, and the resolved values are
    written back so accelerate's "auto" check has nothing to object to."""
    config = override or MemoryPlanConfig.from_ds_config(ds_config)
    if SECTION[0] in ds_config or override is not None:
        ds_config.setdefault(SECTION[0], {})[SECTION[1]] = config.to_dict()
    return config


def wants_memory_plan(ds_config: dict) -> bool:
    """Whether ``ds_config`` runs DeepCompile ZeRO-3 (stage 3 or ``"auto"``): the memory plan's case."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage")
    return bool((ds_config.get("compile") or {}).get("deepcompile")) and stage in (3, "auto")


def _default_schedule(engine):
    """The memory plan's schedule for a ZeRO-3 DeepCompile engine that asks for it, else None."""
    config = engine_plan_config(engine)
    if not plan_applies(engine, config):
        return None
    _, schedule = apply_memory_plan(engine, config)
    log.info("hf_zero3: DeepCompile schedule %s", schedule)
    return schedule


def _before_prepare(accelerator) -> MemoryPlanConfig | None:
    plugin = accelerator.state.deepspeed_plugin
    config, override = plugin.deepspeed_config, getattr(plugin, "_hf_zero3_config", None)
    if not wants_memory_plan(config) and SECTION[0] not in config and override is None:
        return None  # ZeRO-1/2 or no DeepCompile, no section: leave the config (and HF_ZERO3_*) alone
    return resolve_memory_plan_section(config, override)


def _after_prepare(accelerator, engine, config: MemoryPlanConfig | None) -> None:
    if config is None:
        return
    bind_memory_plan_config(engine, config)
    if plan_applies(engine, config) and not getattr(engine, "is_compiled", False):
        # The DeepSpeed launcher drops the YAML's dynamo settings, so accelerate compiled nothing.
        log.info(
            "hf_zero3: compiling the DeepCompile engine accelerate left uncompiled (backend=%s)", config.compile_backend
        )
        engine.compile(backend=config.compile_backend)


def enable_memory_plan() -> None:
    """Install the two wrappers (idempotent). The plan itself is then configured per run by the
    DeepSpeed config's ``hf_zero3.memory_plan`` section (or ``HF_ZERO3_*``)."""
    require("core")
    patches.install(PATCHES[0], lambda: acc_up.patch_deepspeed_compile_default_schedule(_default_schedule))
    patches.install(PATCHES[1], lambda: acc_up.patch_accelerate_prepare_deepspeed(_before_prepare, _after_prepare))


def memory_plan_enabled() -> bool:
    return all(name in patches.installed() for name in PATCHES)


def disable_memory_plan() -> None:
    """Remove the two wrappers (``hf_zero3.unpatch()`` removes every patch)."""
    for name in PATCHES:
        patches.remove(name)


@dataclass
class Zero3DeepSpeedPlugin(DeepSpeedPlugin):
    """accelerate's ``DeepSpeedPlugin`` plus hf_zero3's DeepCompile memory plan.

    ``memory_plan`` (a :class:`MemoryPlanConfig` or a dict of its fields) overrides the DeepSpeed
    config's ``hf_zero3.memory_plan`` section, which overrides ``HF_ZERO3_*``. Everything else is
    accelerate's plugin: ``hf_ds_config`` (or ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` under
    ``accelerate launch``) still names the DeepSpeed config. The memory plan's patches are installed
    only when that config enables DeepCompile.
    """

    memory_plan: Any = field(default=None, metadata={"help": "MemoryPlanConfig or dict of its fields"})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.memory_plan, MemoryPlanConfig):
            config = self.memory_plan
        elif isinstance(self.memory_plan, dict):
            base = dict((self.deepspeed_config.get(SECTION[0]) or {}).get(SECTION[1]) or {})
            config = MemoryPlanConfig.from_dict({**base, **self.memory_plan}, where="Zero3DeepSpeedPlugin.memory_plan")
        elif self.memory_plan is None:
            config = MemoryPlanConfig.from_ds_config(self.deepspeed_config)
        else:
            raise ConfigError(
                f"memory_plan must be a MemoryPlanConfig or a dict, got {type(self.memory_plan).__name__}"
            )
        self._hf_zero3_config = config
        resolve_memory_plan_section(self.deepspeed_config, config)
        if wants_memory_plan(self.deepspeed_config) and config.enabled:
            enable_memory_plan()
        else:
            log.info(
                "hf_zero3: the DeepSpeed config does not enable DeepCompile ZeRO-3 (or the plan is disabled); "
                "no memory plan is installed"
            )
