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
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..agree import Tag, agree, all_equal, all_max
from .gate import counters, drifts, reset_drifts
from .graph_plan import gathered_params
from .planner import PlanError, plan_persistence

log = logging.getLogger("hf_zero3.memory_plan")


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
    """Per-plan calibration state and its steps: :meth:`before_forward` and :meth:`after_step`,
    which the memory plan's pass calls from the engine's ``forward`` and ``step``."""

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

    def before_forward(self, planned: bool, device: bool) -> None:
        """The first training forward after an optimizer step: restart the peak the coming step
        (all its micro-batches) is measured by (``device``: CUDA's peak statistics)."""
        if planned and self.reset_pending and device:
            torch.cuda.reset_peak_memory_stats()
        self.reset_pending = False

    def after_step(
        self,
        records: dict,
        group,
        read_peaks: Callable[[], tuple[int, int, int]],
        *,
        gate: bool,
        persist: bool,
        boundary: bool = True,
        error: BaseException | None = None,
        device: bool = False,
    ) -> Decision | None:
        """``engine.step`` returned (or raised ``error``, shared here with every rank) on a plan of
        ``records`` (not empty): agree this optimizer step's peaks, ``read_peaks()`` = (forward/
        backward, step, reserved), over ``group`` and calibrate or watch. Steps inside a
        gradient-accumulation cycle (``boundary`` False, the same on every rank) are measured with
        the cycle's last one. ``device``: the peaks are CUDA's, whose cache may be emptied. Returns
        the decision on the step that made it; the caller acts on it (gates, persistence)."""
        if error is not None:
            if boundary and not self.planned_since_step:  # the others are on their way to this step's agreement
                agree(Tag("memory_plan.step"), group, [0, 0, 0], error=error)
            raise error  # no agreement in this step: the others fail at their next collective
        if not boundary:
            return None
        self.reset_pending = True
        if self.planned_since_step:  # a compile (and DeepCompile's eager profiling) ran in this step
            self.planned_since_step = False
            if device:
                # The profiler's eager runs leave the cache fragmented (GiBs of reserved-but-free
                # blocks in partly used segments under a cap): hand unused segments back once.
                torch.cuda.empty_cache()
            if self.calibrating:
                self.measured, self.peak_fwd_bwd, self.peak_step, self.peak_reserved = 0, 0, 0, 0
                reset_drifts()
            return None
        peak_fwd_bwd, peak_step, peak_reserved = read_peaks()
        fb, st, res = all_max(
            [int(peak_fwd_bwd), int(peak_step), int(peak_reserved or 0)], group, Tag("memory_plan.step")
        )
        gate_budget = min(r.budget.gate_budget for r in records.values())
        issued = self._issued_since_last_step()  # every step, so the flag is this step's
        decision = None
        if self.calibrating:
            self.measured += 1
            self.peak_fwd_bwd, self.peak_step = max(self.peak_fwd_bwd, fb), max(self.peak_step, st)
            self.peak_reserved = max(self.peak_reserved, res)
            if self.measured >= self.steps:
                decision = self._decide(records, group, gate_budget, persist)
        elif gate and issued and fb > gate_budget:
            # Real forward/backward memory went past the budget while prefetches were in flight:
            # the excess grew by the overshoot; shed prefetches by it (issue counts are agreed).
            over = fb - gate_budget
            self.tighten += over
            if not self.warned:
                self.warned = True
                log.warning(
                    "hf_zero3 memory plan: a step peaked at %.2f GiB, %.2f GiB above the gate budget; "
                    "prefetches are now gated %.2f GiB lower",
                    fb / 2**30,
                    over / 2**30,
                    self.tighten / 2**30,
                )
        limit = max(r.budget.limit for r in records.values())
        if st > limit and not self.warned:
            self.warned = True
            log.warning(
                "hf_zero3 memory plan: a step peaked at %.2f GiB, above the limit of %.2f GiB, outside what the "
                "gate controls (optimizer step, loss, reduce buckets)",
                st / 2**30,
                limit / 2**30,
            )
        self.history.append((fb, st, res, self.tighten))
        return decision

    def _issued_since_last_step(self) -> bool:
        issued = counters()["issued"]
        fresh, self.last_issued = issued > self.last_issued, issued
        return fresh

    def _decide(self, records: dict, group, gate_budget: int, persist: bool) -> Decision:
        """The decision from agreed inputs (its fingerprint checked equal): gates lowered by the
        measured excess, parameters to make persistent within what is left."""
        seen = drifts()
        projected = max(
            (r.profile.peak + seen[(gid, bwd)] for (gid, bwd), r in records.items() if (gid, bwd) in seen),
            default=0,
        )
        time_of, size_of = gathered_params(records)
        d = decide(
            self.peak_fwd_bwd,
            self.peak_step,
            projected,
            gate_budget,
            [(i, size_of[i], time_of[i]) for i in sorted(size_of)],
            persist,
            peak_reserved=self.peak_reserved,
            reserved_limit=min(r.budget.limit - r.budget.safety for r in records.values()),
            planned_fragmentation=max(r.budget.fragmentation for r in records.values()),
        )
        if not all_equal([d.fingerprint(), len(d.persistent)], group, Tag("memory_plan.calibrated")):
            raise PlanError(
                "hf_zero3 memory plan: ranks calibrated differently from agreed measurements; refusing "
                "to run (the all-gathers would be reordered). Please report this."
            )
        self.decision, self.tighten = d, d.tighten
        log.info(
            "hf_zero3 memory plan calibrated over %d steps: real peak %.2f GiB (forward/backward %.2f GiB, "
            "projected %.2f GiB: excess %.2f GiB; reserved %.2f GiB), gate budget %.2f GiB; gate lowered by "
            "%.2f GiB, %d parameters persistent in %.2f GiB of room",
            self.measured,
            self.peak_step / 2**30,
            self.peak_fwd_bwd / 2**30,
            projected / 2**30,
            d.excess / 2**30,
            self.peak_reserved / 2**30,
            gate_budget / 2**30,
            d.tighten / 2**30,
            len(d.persistent),
            max(d.room, 0) / 2**30,
        )
        return d
