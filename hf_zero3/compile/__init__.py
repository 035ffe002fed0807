"""DeepCompile side: a memory-budgeted prefetch/persistence plan and its run-time gate.

* :mod:`.planner` - pure planning functions (CPU-testable): :func:`plan_prefetch`,
  :func:`plan_persistence`.
* :mod:`.profile` / :mod:`.budget` - DeepCompile's profile and the device budget, each agreed
  across the gather group so every rank plans from the same numbers.
* :mod:`.memory_plan` - the DeepCompile pass (a coordinator), its schedule,
  :func:`apply_memory_plan`, :func:`compile_with_memory_plan`; the pass's parts:
  :mod:`.graph_plan` (one graph's agreed plan, the persistent parameters), :mod:`.gate_control`
  (the gate's ops placed in the graph, its budgets set), :mod:`.calibration` (the plan measured on
  real steps, and what that decides), :mod:`.report` (log, dump, summary).
* :mod:`.gate` - the run-time gate's ops (native in ``csrc/`` when built, else PyTorch).
* :mod:`.config` - :class:`MemoryPlanConfig` (DeepSpeed config key ``hf_zero3.memory_plan``,
  env ``HF_ZERO3_*``).
"""

from .config import ConfigError, MemoryPlanConfig
from .memory_plan import apply_memory_plan, compile_with_memory_plan, memory_plan_schedule
from .planner import (
    BudgetTooSmallError,
    GraphProfile,
    NodeProfile,
    PlanError,
    PrefetchPlan,
    plan_persistence,
    plan_prefetch,
)

__all__ = [
    "MemoryPlanConfig",
    "ConfigError",
    "PlanError",
    "BudgetTooSmallError",
    "GraphProfile",
    "NodeProfile",
    "PrefetchPlan",
    "plan_prefetch",
    "plan_persistence",
    "apply_memory_plan",
    "compile_with_memory_plan",
    "memory_plan_schedule",
]
