"""How many bytes the plan may use on this rank, agreed (minimum) over the gather group.

DeepSpeed's passes budget against 90% of ``total_memory()``. A process capped with
``torch.cuda.set_per_process_memory_fraction`` (or sharing the card) then plans for memory it
cannot get. The plan counts in the caching allocator's units (bytes allocated by PyTorch): the
profile is taken in them (:func:`hf_zero3._upstream.deepspeed.patch_deepcompile_profile_in_allocator_units`),
and so are the calibration's peaks and the gate's drift. Memory outside the allocator (CUDA
context, NCCL, other processes on the card) enters once, in the limit::

    cap    = max_memory or total x per-process fraction      # what the caching allocator may hold
    limit  = min(cap, total - non-PyTorch)                   # what it can really get
    budget = limit - fragmentation - safety_margin x cap - reserved

``fragmentation`` is reserved-but-unallocated memory (cached blocks a large gather may not fit
in), ``reserved`` what will be allocated later in the step but is absent from the profile (the
optimizer's states, for a plan made at step 0). Other processes' memory moving after the plan is
made does not move a capped plan; uncapped, the card's free memory at planning time is the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..agree import Tag, all_max, all_min
from ..device_memory import MemoryState
from .config import MemoryPlanConfig


@dataclass(frozen=True)
class MemoryBudget:
    limit: int
    non_pytorch: int
    fragmentation: int
    safety: int
    reserved: int
    budget: int

    @property
    def gate_budget(self) -> int:
        """What the run-time gate compares against: the reservation is measured as drift once it
        is allocated, so it is not subtracted twice."""
        return self.budget + self.reserved

    def describe(self) -> str:
        g = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        return (
            f"budget {g(self.budget)} (allocated) = limit {g(self.limit)} - fragmentation {g(self.fragmentation)} - "
            f"safety {g(self.safety)} - reserved {g(self.reserved)} (non-PyTorch {g(self.non_pytorch)})"
        )


def compute_budget(config: MemoryPlanConfig, state: MemoryState, reserved: int = 0) -> MemoryBudget:
    """This rank's budget from its memory ``state`` (see the module docstring)."""
    cap = int(state.total * state.fraction)
    if config.max_memory is not None:
        cap = min(cap, int(config.max_memory))
    limit = min(cap, state.total - state.non_pytorch)
    safety = int(cap * config.safety_margin)
    budget = limit - state.fragmentation - safety - int(reserved)
    return MemoryBudget(limit, state.non_pytorch, state.fragmentation, safety, int(reserved), budget)


def agree_budget(local: MemoryBudget, group=None) -> MemoryBudget:
    """The group's tightest budget (one all-reduce): every rank then plans against the same number."""
    lo = all_min([local.budget, local.limit], group, Tag("memory_plan.budget"))
    hi = all_max(
        [local.non_pytorch, local.fragmentation, local.safety, local.reserved], group, Tag("memory_plan.budget")
    )
    return MemoryBudget(limit=lo[1], non_pytorch=hi[0], fragmentation=hi[1], safety=hi[2], reserved=hi[3], budget=lo[0])
