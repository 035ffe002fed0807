"""Calibration: the plan checked against the real compiled step, and what that decides.

DeepCompile's profile is an eager run of each graph at compile time. The compiled step is not
that run: inductor's decompositions allocate differently (the backward of a bf16 embedding
accumulates a full fp32 copy of the table), the optimizer's step has its own temporaries, and
what runs between graphs (loss, reduce buckets, allocator rounding under a cap) is in no graph's
profile. A plan that fills the budget from the profile alone can OOM on the first real step.

So the plan is trusted only as far as it has been measured:

1. **Calibration** (the first ``calibrate_steps`` training steps after a compile that planned):
   every graph's gate allows prefetches only up to that graph's own profiled peak (the
   ``match_zero3`` level, which never adds to the step's peak) and nothing is persistent. Each
   step records this rank's real peak: allocated bytes (the plan's and the profile's units) over
   forward + backward (read when ``engine.step`` begins) and over the whole step (when it ends).
2. **Decision** (:func:`decide`), from agreed numbers only (one all-reduce per step, maximum over
   the gather group): ``excess`` = the measured forward/backward peak minus the plan's projection
   (each graph's profiled peak plus the drift its launches agreed), plus cached-but-free memory
   beyond what the plan assumed (under a cap a large request fails on fragmentation, not on
   allocated bytes), lowers every gate's budget; parameters are made persistent by benefit per
   byte within both ``gate budget - measured step peak`` and ``limit - reserved peak - measured
   fragmentation``; what that
   room has left (``headroom``) is all prefetches may add above each graph's profiled peak from then
   on. A job whose calibration found no room stays at match_zero3's level: the default degrades
   to it instead of crashing (persistent and prefetched buffers carved out of the cache can leave a
   large optimizer temporary no block to fit in under a cap, even with allocated bytes to spare).
3. **Watch** (every later step): a step whose agreed peak passes the gate budget while the gate
   let prefetches through lowers the gate budget by the overshoot (never raised again), and says
   so once.

A "step" is an optimizer step: with gradient accumulation, ``engine.step`` calls inside a cycle
(``is_gradient_accumulation_boundary()`` false, the same on every rank) are measured together
with the cycle's last one, and an exception raised by ``engine.step`` on one rank is shared with
every rank at that step's agreement.

Every input of a decision is agreed before anything is acted on, so every rank persists the same
parameters in the same order (DeepCompile's ``set_persistent`` all-gathers) and its gates take the
same decisions. Peaks are read with ``torch.cuda.max_memory_allocated`` and reset when the first
training forward after an optimizer step begins (as DeepCompile's own profiler resets them during
a compile), so a user who resets them at the start of a step and reads them after the optimizer
step still reads the whole step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from .planner import plan_persistence

__all__ = ["Decision", "decide", "Calibration"]


@dataclass(frozen=True)
class Decision:
    """What one calibration decided: gate budget lowered by ``tighten`` bytes, these persistent."""

    tighten: int
    persistent: tuple[int, ...]
    room: int
    excess: int
    headroom: int = 0  # what prefetches may still add above each graph's profiled peak (room - persisted)

    def fingerprint(self) -> int:
        h = hashlib.blake2b(repr((self.tighten, self.persistent, self.headroom)).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") >> 1


def decide(
    peak_fwd_bwd: int,
    peak_step: int,
    projected: int,
    gate_budget: int,
    candidates: Sequence[tuple[int, int, float]],
    persist: bool,
    *,
    peak_reserved: int = 0,
    reserved_limit: int | None = None,
    planned_fragmentation: int = 0,
) -> Decision:
    """The calibration's decision from agreed measurements (a pure function: equal inputs, equal
    decision on every rank). All sizes in the caching allocator's bytes (the plan's units).

    ``projected``: the plan's own forecast of the forward/backward peak at the calibration level
    (max over planned graphs of profiled peak + agreed drift); 0 when no graph has a launch to
    measure. ``peak_reserved``: the allocator's reserved peak; under a cap what OOMs is reserved
    memory (fragmented cached blocks a large request does not fit in), so cached-but-free memory
    beyond what the plan assumed (``planned_fragmentation``) lowers the gate too, and persistent
    bytes must also fit under ``reserved_limit - peak_reserved``. ``candidates``: (ds_id, bytes,
    profiled gather time) of every gathered parameter."""
    excess = int(peak_fwd_bwd) - int(projected) if projected > 0 else 0
    fragmentation = max(0, int(peak_reserved) - int(max(peak_fwd_bwd, peak_step)))
    tighten = max(0, excess) + max(0, fragmentation - int(planned_fragmentation))
    room = int(gate_budget) - int(max(peak_fwd_bwd, peak_step))
    if reserved_limit is not None:
        # New long-lived buffers can fragment the cache as much again as it already is: only reserved
        # headroom beyond the measured fragmentation is room (persisting exactly the reserved
        # headroom left the optimizer's next temporary short under a cap: it OOMed at the next step).
        room = min(room, int(reserved_limit) - int(peak_reserved) - fragmentation)
    chosen = plan_persistence(candidates, 0, room) if persist and room > 0 else ()
    size = {int(c[0]): int(c[1]) for c in candidates}
    headroom = max(0, room - sum(size[i] for i in chosen))
    return Decision(tighten=tighten, persistent=tuple(chosen), room=room, excess=excess, headroom=headroom)


@dataclass
class Calibration:
    """Per-plan calibration state; :meth:`MemoryPlanPass.after_step` drives it."""

    steps: int  # training steps to measure before deciding
    measured: int = 0  # steps measured since the last compile that planned
    peak_fwd_bwd: int = 0  # agreed, max over the measured steps
    peak_step: int = 0
    peak_reserved: int = 0
    decision: Decision | None = None
    tighten: int = 0  # current lowering of every gate budget (bytes)
    planned_since_step: bool = False  # a graph was planned since the last step: skip its peak
    warned: bool = False
    last_issued: int = 0  # the gate's issued-prefetch count at the last watched step
    reset_pending: bool = True  # the next training forward starts a new optimizer step's measurement
    history: list = field(default_factory=list)  # (agreed fwd/bwd, step, reserved peak, tighten) per step

    @property
    def calibrating(self) -> bool:
        return self.decision is None and self.steps > 0
