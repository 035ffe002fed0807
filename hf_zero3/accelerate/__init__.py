"""accelerate integration: :class:`Zero3DeepSpeedPlugin` and :func:`enable_memory_plan`."""

from .plugin import Zero3DeepSpeedPlugin, disable_memory_plan, enable_memory_plan, memory_plan_enabled

__all__ = ["Zero3DeepSpeedPlugin", "enable_memory_plan", "disable_memory_plan", "memory_plan_enabled"]
