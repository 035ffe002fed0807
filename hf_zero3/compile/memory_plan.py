"""The DeepCompile pass that replaces ``prefetch`` + ``selective_gather`` with one budgeted plan.

Per graph (forward and backward), after DeepSpeed's ``zero3_compile`` pass has inserted the
all-gathers and releases and DeepCompile has profiled the result:

1. the profile is agreed across the gather group (:func:`agree_profile`) and so is the budget
   (:func:`agree_budget`), so every rank plans from identical inputs;
2. :func:`plan_prefetch` places fused prefetches under the budget; the plan's fingerprint is
   checked equal on all ranks (a mismatch raises rather than reordering NCCL all-gathers);
3. the graph gets one ``hf_zero3::agree_launch`` and one ``hf_zero3::gated_prefetch`` per slot;
4. the plan is then calibrated on real steps (:mod:`hf_zero3.compile.calibration`): prefetches stay
   at ``match_zero3``'s level for ``calibrate_steps`` steps, whose agreed real peak sets how far the
   gate may go and which parameters become persistent (by benefit per byte within what is left);
   every later step's agreed peak keeps the gate below the budget. With ``calibrate_steps=0`` the
   profile is trusted: persistence is chosen on the last backward graph at compile time.

Entry points: :func:`apply_memory_plan` (register the pass on an engine, return the schedule)
and :func:`compile_with_memory_plan` (that, then ``engine.compile``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from hf_zero3.compile.budget import MemoryBudget, agree_budget, compute_budget
from hf_zero3.compile.calibration import Calibration, Decision, decide
from hf_zero3.compile.config import ConfigError, MemoryPlanConfig
from hf_zero3.compile.planner import (
    GATHER,
    GraphProfile,
    PlanError,
    PrefetchPlan,
    check_floor,
    plan_persistence,
    plan_prefetch,
)
from hf_zero3.compile.profile import agree_profile, profile_complete, profile_from_deepcompile

__all__ = [
    "PASS_NAME",
    "MemoryPlanPass",
    "memory_plan_schedule",
    "apply_memory_plan",
    "compile_with_memory_plan",
    "pass_contract",
    "engine_plan_config",
    "plan_applies",
]

log = logging.getLogger("hf_zero3.memory_plan")
PASS_NAME = "hf_zero3_memory_plan"
ZERO3_PASS = "zero3_compile"


def pass_contract():
    from hf_zero3._upstream.deepspeed import gather_release_contract

    # Reorders zero3_compile's all-gathers and sets persistence, as prefetch + selective_gather do.
    return gather_release_contract(frozenset({"prefetch", "selective_gather"}))


def memory_plan_schedule(config: MemoryPlanConfig) -> list:
    """DeepCompile schedule: the plan at ``plan_step`` (0: the only compile)."""
    if config.plan_step == 0:
        return [(0, [ZERO3_PASS, PASS_NAME])]
    return [(0, [ZERO3_PASS]), (config.plan_step, [ZERO3_PASS, PASS_NAME])]


@dataclass
class PlanRecord:
    profile: GraphProfile
    plan: PrefetchPlan
    budget: MemoryBudget


@dataclass
class MemoryPlanPass:
    """The pass DeepCompile calls once per graph; holds this compile cycle's plans for reports."""

    config: MemoryPlanConfig
    engine: object = None
    runtime: object = None  # whose gather group the agreements use (default: the engine's runtime)
    # Seams for CPU tests, which drive the pass on recorded graphs without CUDA or DeepCompile:
    ops: dict | None = None  # FX target -> node kind (default: DeepCompile's dc ops)
    read_memory: Callable | None = None  # () -> MemoryState (default: this CUDA device)
    persist_fn: Callable | None = None  # ds_id -> None (default: DeepCompile's set_persistent)
    read_peaks: Callable | None = None  # () -> (fwd/bwd, step, reserved peak), allocator bytes (default: CUDA's)
    records: dict = field(default_factory=dict)
    persistent: tuple = ()
    persistent_bytes: int = 0
    error: Exception | None = None
    calibration: Calibration | None = None

    def __post_init__(self):
        if self.calibration is None:
            self.calibration = Calibration(self.config.calibrate_steps)

    def memory(self):
        from hf_zero3.compile.gate import memory_state

        return (self.read_memory or memory_state)()

    def group(self, prof):
        """The engine's own gather group (its runtime's); the profile's only for a pass bound to none."""
        rt = self.runtime
        if rt is None and self.engine is not None:
            from hf_zero3.runtime import runtime_of

            rt = runtime_of(self.engine)
        return rt.group if rt is not None else getattr(prof, "process_group", None)

    def budget(self, group) -> MemoryBudget:
        from hf_zero3._upstream.deepspeed import pending_optimizer_bytes

        reserved = pending_optimizer_bytes(self.engine) if self.engine is not None else 0
        return agree_budget(compute_budget(self.config, self.memory(), reserved), group)

    def __call__(self, gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
        # Dynamo turns a backend exception into a graph break (and a confusing failure later), so
        # a plan error leaves this graph unplanned and is raised by the engine's next forward.
        # Everything that can fail on one rank (planning, its agreements, choosing persistence)
        # runs before the graph is touched, and its outcome is agreed: a failure on any rank
        # leaves the graph unplanned on every rank.
        from hf_zero3._upstream.torch import real_tensors
        from hf_zero3.agree import Tag, agree
        from hf_zero3.errors import Zero3Error

        self.calibration.planned_since_step = True  # this step's peak includes compiling and profiling
        with real_tensors():  # the agreements below are real collectives
            try:
                prepared, error = self._prepare(graph_id, graph_order, profiling_results, bwd), None
            except Exception as exc:  # noqa: BLE001 - shared, then re-raised from the next forward
                prepared, error = None, exc
            try:
                if isinstance(error, Zero3Error):
                    raise error  # an agreement inside planning shared it with every rank already
                agree(
                    Tag("memory_plan.graph", {"bwd": bool(bwd)}), self.group(profiling_results[graph_id]), error=error
                )
            except Exception as exc:  # noqa: BLE001
                log.error("hf_zero3 memory plan failed: %s", exc)
                self.error = self.error or exc
                self.records.pop((graph_id, bwd), None)
                return None
        if prepared is None:
            return None
        return self._apply(gm, graph_id, bwd, *prepared)

    def _prepare(self, graph_id, graph_order, profiling_results, bwd):
        """Plan the graph (agreed profile, budget and plan) and, on the last backward graph, choose
        the persistent parameters; None for a graph DeepCompile could not profile. Touches no graph."""
        prof = profiling_results[graph_id]
        group = self.group(prof)
        if not profile_complete(prof, bwd):  # DeepCompile agrees completeness across ranks
            log.warning(
                "hf_zero3 memory plan: graph %s (%s) has an incomplete profile; left unplanned",
                graph_id,
                "bwd" if bwd else "fwd",
            )
            return None
        graph = prof.bwd_graph if bwd else prof.fwd_graph
        profile = agree_profile(profile_from_deepcompile(graph, prof, graph_id, bwd, ops=self.ops), group)
        budget = self.budget(group)
        check_floor(profile, budget.limit - budget.safety, budget.reserved)  # raises: no schedule fits
        plan_budget = budget.budget if self.config.mode == "budget" else min(budget.budget, profile.peak)
        plan = plan_prefetch(
            profile, plan_budget, max_fuse_bytes=self.config.max_fuse_bytes, coalesce=self.config.coalesce
        )
        from hf_zero3.agree import Tag, all_equal

        if not all_equal([plan.fingerprint(), len(plan.slots)], group, Tag("memory_plan.plan")):
            raise PlanError(
                f"hf_zero3 memory plan: ranks built different plans for graph {graph_id} from agreed "
                f"inputs; refusing to run (the all-gathers would be reordered). Please report this."
            )
        self.records[(graph_id, bwd)] = PlanRecord(profile, plan, budget)
        chosen = None
        if (
            bwd
            and self.config.persist
            and self.config.mode == "budget"
            and self.config.calibrate_steps == 0
            and _is_last_backward(graph_id, graph_order)
        ):
            chosen = self._choose_persistent(profiling_results, group, budget)
        return profile, plan, budget, group, chosen

    def _apply(self, gm, graph_id, bwd, profile, plan, budget, group, chosen):
        _rewrite(gm, profile, plan, graph_id, budget.gate_budget, gate=self.config.gate, group=group, bwd=bwd)
        if self.config.gate:
            self._set_gates()
        _dump(profile, plan, budget)
        log.info(
            "hf_zero3 memory plan graph %s %s: %s; %d of %d gathers prefetched in %d slots, projected peak %.2f GiB",
            graph_id,
            "bwd" if bwd else "fwd",
            budget.describe(),
            plan.prefetched,
            len(profile.gathers()),
            len(plan.slots),
            plan.peak / 2**30,
        )
        if chosen is not None:
            try:  # gm is rewritten already: hand it back whatever happens here
                self._persist(*chosen, group)
            except Exception as exc:  # noqa: BLE001 - re-raised from the next forward
                log.error("hf_zero3 memory plan: persistence failed: %s", exc)
                self.error = self.error or exc
        return gm

    def _choose_persistent(self, profiling_results, group, budget: MemoryBudget) -> tuple[tuple, dict]:
        """(parameter ids to keep gathered, their sizes): agreed, by benefit per byte within what the
        budget has left over every planned graph's peak."""
        from hf_zero3._upstream.deepspeed import profile_all_peaks
        from hf_zero3.agree import Tag, all_equal, all_max

        peaks = [r.plan.peak for r in self.records.values()]
        for pr in profiling_results.values():  # graphs re-profiled after their plan
            peaks += profile_all_peaks(pr)
        now = self.memory()
        tag = Tag("memory_plan.persist")
        peak = all_max([max(peaks, default=0), now.allocated], group, tag)  # the allocator's units
        time_of, size_of = self._gathered_params()
        chosen = plan_persistence([(d, size_of[d], time_of[d]) for d in sorted(size_of)], max(peak), budget.budget)
        if not all_equal([len(chosen), hash(chosen) & 0x7FFFFFFFFFFFFFFF], group, tag):
            raise PlanError("hf_zero3 memory plan: ranks chose different persistent parameters; refusing to run")
        return chosen, size_of

    def _gathered_params(self) -> tuple[dict, dict]:
        """(ds_id -> total profiled gather time, ds_id -> gathered bytes) over the planned graphs."""
        time_of, size_of = {}, {}
        for rec in self.records.values():
            for nd in rec.profile.nodes:
                if nd.kind == GATHER:
                    time_of[nd.ds_id] = time_of.get(nd.ds_id, 0.0) + nd.time
                    size_of[nd.ds_id] = nd.nbytes
        return time_of, size_of

    def _persist(self, chosen: tuple, size_of: dict, group=None) -> None:
        """Keep ``chosen`` gathered. Each ``set_persistent`` is a collective: a rank that could not
        allocate one mid-way would leave the others in its all-gather, so the group first agrees
        that every rank can allocate them all (else none persists, on every rank alike)."""
        from hf_zero3._upstream.deepspeed import deepcompile_handle
        from hf_zero3.agree import Tag, all_min

        persist = self.persist_fn or deepcompile_handle().set_persistent
        if self.persist_fn is None and torch.cuda.is_available():
            # Persistent buffers carved out of a cached block that a per-step temporary (the
            # optimizer's fp32 sub-group gradient) reuses every step would leave it no block to fit
            # in under a cap: hand free segments back first, so they go to fresh segments instead.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        need = sum(size_of[d] for d in chosen)
        (room,) = all_min([self.memory().allocatable - need], group, Tag("memory_plan.persist_fits"))
        if room < 0:
            log.warning(
                "hf_zero3 memory plan: a rank of the group cannot allocate the %.2f GiB chosen to stay "
                "gathered (short by %.2f GiB); nothing is made persistent",
                need / 2**30,
                -room / 2**30,
            )
            return
        for ds_id in chosen:
            persist(ds_id)
        self.persistent = chosen
        self.persistent_bytes = sum(size_of[d] for d in chosen)
        log.info(
            "hf_zero3 memory plan: %d parameters persistent (%.2f GiB)", len(chosen), self.persistent_bytes / 2**30
        )

    # --- calibration (see hf_zero3.compile.calibration) -----------------------------------------

    def before_forward(self) -> None:
        """The first training forward after an optimizer step: restart the peak the coming step
        (all its micro-batches) is measured by."""
        if self.records and self.calibration.reset_pending and self.read_peaks is None and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.calibration.reset_pending = False

    def peak_now(self) -> int:
        """This rank's allocated peak since :meth:`before_forward`."""
        return self.peaks_now()[0]

    def peaks_now(self) -> tuple[int, int]:
        """(allocated, reserved) peaks since :meth:`before_forward`, in the allocator's units."""
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def after_step(
        self,
        peak_fwd_bwd: int | None = None,
        peak_step: int | None = None,
        peak_reserved: int | None = None,
        *,
        boundary: bool = True,
        error: BaseException | None = None,
    ) -> Decision | None:
        """``engine.step`` returned (or raised ``error``, shared here with every rank): agree this
        optimizer step's peaks over the gather group and calibrate or watch. ``peak_*`` default to
        :attr:`read_peaks` / CUDA's. Steps inside a gradient-accumulation cycle (``boundary``
        False, the same on every rank) are measured with the cycle's last one. Returns the
        calibration's decision on the step that made it."""
        from hf_zero3.agree import Tag, agree, all_max

        cal = self.calibration
        if not self.records:  # agreed: a graph is recorded only when every rank planned it
            if error is not None:
                raise error
            return None
        if error is not None:
            if boundary and not cal.planned_since_step:  # the others are on their way to this step's agreement
                agree(Tag("memory_plan.step"), self.group(None), [0, 0, 0], error=error)
            raise error  # no agreement in this step: the others fail at their next collective
        if not boundary:
            return None
        cal.reset_pending = True
        if cal.planned_since_step:  # a compile (and DeepCompile's eager profiling) ran in this step
            cal.planned_since_step = False
            if self.read_peaks is None and torch.cuda.is_available():
                # The profiler's eager runs leave the cache fragmented (GiBs of reserved-but-free
                # blocks in partly used segments under a cap): hand unused segments back once.
                torch.cuda.empty_cache()
            if cal.calibrating:
                from hf_zero3.compile.gate import reset_drifts

                cal.measured, cal.peak_fwd_bwd, cal.peak_step, cal.peak_reserved = 0, 0, 0, 0
                reset_drifts()
            return None
        if peak_step is None:
            if self.read_peaks is not None:
                peak_fwd_bwd, peak_step, peak_reserved = self.read_peaks()
            else:
                peak_step, peak_reserved = self.peaks_now()
                peak_fwd_bwd = peak_step if peak_fwd_bwd is None else peak_fwd_bwd
        group = self.group(None)
        fb, st, res = all_max(
            [int(peak_fwd_bwd), int(peak_step), int(peak_reserved or 0)], group, Tag("memory_plan.step")
        )
        gate_budget = min(r.budget.gate_budget for r in self.records.values())
        issued = self._issued_since_last_step()  # every step, so the flag is this step's
        decision = None
        if cal.calibrating:
            cal.measured += 1
            cal.peak_fwd_bwd, cal.peak_step = max(cal.peak_fwd_bwd, fb), max(cal.peak_step, st)
            cal.peak_reserved = max(cal.peak_reserved, res)
            if cal.measured >= cal.steps:
                decision = self._decide(group, gate_budget)
        elif self.config.gate and issued and fb > gate_budget:
            # Real forward/backward memory went past the budget while prefetches were in flight:
            # the excess grew by the overshoot; shed prefetches by it (issue counts are agreed).
            over = fb - gate_budget
            cal.tighten += over
            self._set_gates()
            if not cal.warned:
                cal.warned = True
                log.warning(
                    "hf_zero3 memory plan: a step peaked at %.2f GiB, %.2f GiB above the gate budget; "
                    "prefetches are now gated %.2f GiB lower",
                    fb / 2**30,
                    over / 2**30,
                    cal.tighten / 2**30,
                )
        limit = max(r.budget.limit for r in self.records.values())
        if st > limit and not cal.warned:
            cal.warned = True
            log.warning(
                "hf_zero3 memory plan: a step peaked at %.2f GiB, above the limit of %.2f GiB, outside what the "
                "gate controls (optimizer step, loss, reduce buckets)",
                st / 2**30,
                limit / 2**30,
            )
        cal.history.append((fb, st, res, cal.tighten))
        return decision

    def _issued_since_last_step(self) -> bool:
        from hf_zero3.compile.gate import counters

        issued = counters()["issued"]
        fresh, self.calibration.last_issued = issued > self.calibration.last_issued, issued
        return fresh

    def _decide(self, group, gate_budget: int) -> Decision:
        """The calibration's decision (agreed inputs; its fingerprint checked equal), then acted on:
        gates lowered by the measured excess, parameters made persistent within what is left."""
        from hf_zero3.agree import Tag, all_equal
        from hf_zero3.compile.gate import drifts

        cal = self.calibration
        seen = drifts()
        projected = max(
            (r.profile.peak + seen[(gid, bwd)] for (gid, bwd), r in self.records.items() if (gid, bwd) in seen),
            default=0,
        )
        time_of, size_of = self._gathered_params()
        persist = self.config.persist and self.config.mode == "budget"
        d = decide(
            cal.peak_fwd_bwd,
            cal.peak_step,
            projected,
            gate_budget,
            [(i, size_of[i], time_of[i]) for i in sorted(size_of)],
            persist,
            peak_reserved=cal.peak_reserved,
            reserved_limit=min(r.budget.limit - r.budget.safety for r in self.records.values()),
            planned_fragmentation=max(r.budget.fragmentation for r in self.records.values()),
        )
        if not all_equal([d.fingerprint(), len(d.persistent)], group, Tag("memory_plan.calibrated")):
            raise PlanError(
                "hf_zero3 memory plan: ranks calibrated differently from agreed measurements; refusing "
                "to run (the all-gathers would be reordered). Please report this."
            )
        cal.decision, cal.tighten = d, d.tighten
        self._set_gates()
        log.info(
            "hf_zero3 memory plan calibrated over %d steps: real peak %.2f GiB (forward/backward %.2f GiB, "
            "projected %.2f GiB: excess %.2f GiB; reserved %.2f GiB), gate budget %.2f GiB; gate lowered by "
            "%.2f GiB, %d parameters persistent in %.2f GiB of room",
            cal.measured,
            cal.peak_step / 2**30,
            cal.peak_fwd_bwd / 2**30,
            projected / 2**30,
            d.excess / 2**30,
            cal.peak_reserved / 2**30,
            gate_budget / 2**30,
            d.tighten / 2**30,
            len(d.persistent),
            max(d.room, 0) / 2**30,
        )
        if d.persistent:
            self._persist(d.persistent, size_of, group)
        return d

    def _set_gates(self) -> None:
        """Every planned graph's gate: lowered by ``tighten``, and no higher than its profiled peak plus
        the calibration's measured headroom (while calibrating: plus nothing)."""
        from hf_zero3.compile.gate import set_adjust

        cal = self.calibration
        for key, rec in self.records.items():
            if cal.decision is None:
                cap = rec.profile.peak if cal.calibrating and self.config.mode == "budget" else None
            else:
                cap = rec.profile.peak + cal.decision.headroom
            set_adjust(key, cap, cal.tighten)

    def summary(self) -> dict:
        return {
            "graphs": len(self.records),
            "prefetched": sum(r.plan.prefetched for r in self.records.values()),
            "gathers": sum(len(r.profile.gathers()) for r in self.records.values()),
            "slots": sum(len(r.plan.slots) for r in self.records.values()),
            "projected_peak": max((r.plan.peak for r in self.records.values()), default=0),
            "budget": min((r.budget.budget for r in self.records.values()), default=0),
            "persistent": len(self.persistent),
            "persistent_bytes": self.persistent_bytes,
            "calibrated": self.calibration.decision is not None,
            "gate_tighten": self.calibration.tighten,
        }


def _dump(profile: GraphProfile, plan: PrefetchPlan, budget: MemoryBudget) -> None:
    """With HF_ZERO3_PLAN_DUMP=<dir>, rank 0 writes each agreed profile and its plan as JSON."""
    import json
    import os

    out = os.environ.get("HF_ZERO3_PLAN_DUMP")
    if not out or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    os.makedirs(out, exist_ok=True)
    name = f"graph{len(os.listdir(out)):02d}_{'bwd' if profile.bwd else 'fwd'}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(
            {
                "profile": profile.to_json(),
                "budget": budget.__dict__,
                "plan": {
                    "budget": plan.budget,
                    "prefetched": plan.prefetched,
                    "peak": plan.peak,
                    "slots": [[s.index, list(s.ds_ids), s.nbytes, s.window_peak] for s in plan.slots],
                },
            },
            f,
        )


def _is_last_backward(graph_id, graph_order) -> bool:
    # Backward runs graphs in reverse: the first forward graph needing backward is the last one.
    for g, needs_bwd in graph_order:
        if needs_bwd:
            return g == graph_id
    return False


def _rewrite(
    gm,
    profile: GraphProfile,
    plan: PrefetchPlan,
    graph_id: int,
    gate_budget: int,
    *,
    gate: bool,
    group=None,
    bwd: bool = False,
) -> None:
    """Insert the launch agreement and the gated prefetches before their planned nodes."""
    if not plan.slots:
        return
    from hf_zero3.compile import gate as gate_mod

    nodes = list(gm.graph.nodes)
    if len(nodes) != len(profile.nodes) or any(n.name != p.name for n, p in zip(nodes, profile.nodes)):
        raise PlanError(f"graph {graph_id} changed between profiling and planning; cannot place prefetches")
    launch = None
    if gate:
        gate_mod.register_ops()
        gate_mod.set_launch_group(graph_id, group)
        first = plan.slots[0]
        anchor = nodes[first.gather_nodes[0]].args[0]
        with gm.graph.inserting_before(nodes[first.index]):
            launch = gm.graph.call_function(
                torch.ops.hf_zero3.agree_launch.default,
                (anchor, graph_id, profile.nodes[first.index - 1].alloc, gate_budget, int(bool(bwd))),
            )
        _profile_meta(launch)
    for slot in plan.slots:
        params = [nodes[u].args[0] for u in slot.gather_nodes]
        with gm.graph.inserting_before(nodes[slot.index]):
            if gate:
                new = gm.graph.call_function(
                    torch.ops.hf_zero3.gated_prefetch.default,
                    (graph_id, params, list(slot.ds_ids), slot.nbytes, slot.window_peak, launch),
                )
            else:
                from hf_zero3._upstream.deepspeed import dc_prefetch_op

                new = gm.graph.call_function(dc_prefetch_op(), (graph_id, params, list(slot.ds_ids)))
        _profile_meta(new)
    gm.graph.lint()


def _profile_meta(node) -> None:
    # DeepCompile's profiler treats nodes without its metadata keys as unprofiled.
    from hf_zero3.compile.profile import profile_meta_defaults

    for key, default in profile_meta_defaults().items():
        node.meta.setdefault(key, default)


class _Dispatcher:
    """The one callable registered under :data:`PASS_NAME`.

    DeepCompile's pass table and schedule are process-wide (DeepSpeed 0.19.8): a second engine's
    ``compile`` replaces the first one's schedule, so a pass bound to one engine would plan another
    engine's graphs (a TRL reference or teacher model). This dispatcher hands each graph to the plan
    of the engine whose parameters the graph takes (DeepSpeed parameter ids are process-unique).
    """

    def __init__(self):
        self._plans: list = []  # weak references to MemoryPlanPass objects

    def others(self, planner: "MemoryPlanPass") -> list:
        """Live plans of other engines."""
        return [
            p
            for p in (r() for r in self._plans)
            if p is not None and p is not planner and p.engine is not planner.engine
        ]

    def add(self, planner: "MemoryPlanPass") -> None:
        import weakref

        self._plans = [r for r in self._plans if r() is not None and r() is not planner] + [weakref.ref(planner)]

    def route(self, param_manager, graph_id) -> "MemoryPlanPass | None":
        from hf_zero3._upstream.deepspeed import graph_param_ids
        from hf_zero3.runtime import runtime_of

        plans = [p for p in (r() for r in self._plans) if p is not None]
        ids = graph_param_ids(param_manager, graph_id) if param_manager is not None else set()
        if ids:
            owners = [p for p in plans if p.engine is not None and ids <= runtime_of(p.engine).param_ids()]
            if len(owners) == 1:
                return owners[0]
        return plans[0] if len(plans) == 1 and not ids else None

    def __call__(self, gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
        planner = self.route(param_manager, graph_id)
        if planner is None:
            log.error(
                "hf_zero3 memory plan: graph %s belongs to no engine with a memory plan; left unplanned", graph_id
            )
            return None
        return planner(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)


_DISPATCHER = _Dispatcher()


def engine_plan_config(engine) -> MemoryPlanConfig:
    """The settings for ``engine``: what accelerate's prepare resolved (kept on its runtime), else its
    DeepSpeed config's ``hf_zero3.memory_plan`` section (and ``HF_ZERO3_*``)."""
    from hf_zero3.runtime import runtime_of

    config = runtime_of(engine).memory_plan_config
    if config is None:
        raw = getattr(engine, "config", None)
        config = MemoryPlanConfig.from_ds_config(raw if isinstance(raw, dict) else {})
    return config


def plan_applies(engine, config: MemoryPlanConfig) -> bool:
    """The plan is on and the engine is a ZeRO-3 DeepCompile engine."""
    from hf_zero3._upstream.deepspeed import deepcompile_enabled, engine_zero_stage

    return config.enabled and deepcompile_enabled(engine) and engine_zero_stage(engine) == 3


def apply_memory_plan(engine, config: MemoryPlanConfig | None = None) -> tuple[MemoryPlanPass, list]:
    """Bind a memory-plan pass to ``engine`` (its runtime keeps it); returns (pass, schedule for
    ``engine.compile``). Several engines in one process each keep their own plan."""
    from hf_zero3._upstream.deepspeed import (
        deepcompile_enabled,
        deepcompile_supported,
        engine_zero_stage,
        register_compile_pass,
    )
    from hf_zero3._upstream.versions import require
    from hf_zero3.runtime import runtime_of

    require("core")
    config = config or engine_plan_config(engine)
    ok, why = deepcompile_supported()
    if not ok:
        raise ConfigError(f"hf_zero3 memory plan needs DeepCompile, which is unavailable: {why}")
    if not deepcompile_enabled(engine):
        raise ConfigError('the DeepSpeed config does not enable DeepCompile; add "compile": {"deepcompile": true}')
    if engine_zero_stage(engine) != 3:
        raise ConfigError(
            f"the memory plan schedules ZeRO-3 all-gathers; this engine runs ZeRO stage "
            f"{engine_zero_stage(engine)} (set zero_optimization.stage to 3)"
        )
    rt = runtime_of(engine)
    planner = MemoryPlanPass(config, engine, runtime=rt)
    register_compile_pass(PASS_NAME, _DISPATCHER, pass_contract())
    from hf_zero3._upstream import patches
    from hf_zero3._upstream.deepspeed import patch_deepcompile_profile_in_allocator_units

    patches.install("deepcompile_profile_in_allocator_units", patch_deepcompile_profile_in_allocator_units)
    if _DISPATCHER.others(planner):
        log.warning(
            "hf_zero3: a second DeepCompile engine in this process. DeepSpeed 0.19.8 keeps one DeepCompile "
            "native state per process, owned by the engine compiled last: only that engine may run its "
            "compiled graph. Compile the engine you train last; evaluate the others through "
            "hf_zero3.eval_forward / Zero3Safe (eager, gathered). Each keeps its own memory plan."
        )
    _DISPATCHER.add(planner)
    from hf_zero3.compile.gate import register_ops

    register_ops()
    rt.memory_plan, rt.memory_plan_config = planner, config
    _raise_plan_errors_from_forward(engine, rt)
    return planner, memory_plan_schedule(config)


def _raise_plan_errors_from_forward(engine, rt) -> None:
    """Wrap ``engine.forward`` (raise a plan error; a training forward restarts the peak the step is
    measured by) and ``engine.step`` (the step's peaks go to the calibration, agreed)."""
    if getattr(engine.forward, "_hf_zero3_checks_plan", False):
        return
    forward = engine.forward

    def checked_forward(*args, **kwargs):
        planner = rt.memory_plan
        if planner is not None and torch.is_grad_enabled():
            planner.before_forward()
        out = forward(*args, **kwargs)
        if planner is not None and planner.error is not None:
            raise planner.error
        return out

    checked_forward._hf_zero3_checks_plan = True
    engine.forward = checked_forward
    step = getattr(engine, "step", None)
    if step is None:
        return

    def measured_step(*args, **kwargs):
        from hf_zero3._upstream.deepspeed import accumulation_boundary

        planner = rt.memory_plan
        if planner is None:
            return step(*args, **kwargs)
        boundary = accumulation_boundary(engine)  # before step() advances it; equal on every rank
        before = planner.peak_now() if planner.records and planner.read_peaks is None and boundary else None
        try:
            out = step(*args, **kwargs)
        except Exception as exc:  # every rank raises it (they meet in this step's agreement)
            planner.after_step(boundary=boundary, error=exc)
            raise
        planner.after_step(before, None, boundary=boundary)
        return out

    measured_step._hf_zero3_measures_plan = True
    engine.step = measured_step


def compile_with_memory_plan(
    engine, config: MemoryPlanConfig | None = None, backend: str | None = None, compile_kwargs: dict | None = None
) -> MemoryPlanPass:
    """Register the pass and compile ``engine`` with its schedule. On an engine someone already
    compiled (accelerate) but that has not run a compiled step, the schedule is swapped in."""
    from hf_zero3._upstream.deepspeed import engine_is_compiled, replace_pending_schedule

    planner, schedule = apply_memory_plan(engine, config)
    if engine_is_compiled(engine):
        if not replace_pending_schedule(engine, schedule):
            raise ConfigError(
                "the engine was compiled and has already run compiled steps with another schedule; "
                "apply the memory plan before the first training step"
            )
    else:
        engine.compile(
            backend=backend or planner.config.compile_backend, compile_kwargs=compile_kwargs or {}, schedule=schedule
        )
    return planner
