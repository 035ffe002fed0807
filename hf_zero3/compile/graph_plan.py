"""One graph's plan, from inputs every rank of the gather group agreed, and the persistent parameters.

Each step's collective is an agreement, so every rank plans from the same profile and budget and
builds the same plan; a plan or a persistent set that still differs between ranks raises rather
than reorder the NCCL all-gathers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .._upstream.deepspeed import deepcompile_handle, profile_all_peaks
from ..agree import Tag, all_equal, all_max, all_min
from ..device_memory import MemoryState
from .budget import MemoryBudget
from .config import MemoryPlanConfig
from .planner import GATHER, GraphProfile, PlanError, PrefetchPlan, check_floor, plan_persistence, plan_prefetch
from .profile import agree_profile, profile_complete, profile_from_deepcompile

log = logging.getLogger("hf_zero3.memory_plan")


@dataclass
class PlanRecord:
    profile: GraphProfile
    plan: PrefetchPlan
    budget: MemoryBudget


def agreed_profile(prof, graph_id: int, bwd: bool, group, ops=None) -> GraphProfile | None:
    """DeepCompile's profile of the graph, agreed over ``group``; None where it is incomplete
    (DeepCompile agrees completeness across ranks)."""
    if not profile_complete(prof, bwd):
        log.warning(
            "hf_zero3 memory plan: graph %s (%s) has an incomplete profile; left unplanned",
            graph_id,
            "bwd" if bwd else "fwd",
        )
        return None
    graph = prof.bwd_graph if bwd else prof.fwd_graph
    return agree_profile(profile_from_deepcompile(graph, prof, graph_id, bwd, ops=ops), group)


def plan_graph(profile: GraphProfile, budget: MemoryBudget, config: MemoryPlanConfig, group) -> PlanRecord:
    """The prefetch plan under the agreed ``budget`` (``match_zero3``: no higher than the graph's
    own peak); raises where no schedule fits or where ranks built different plans."""
    check_floor(profile, budget.limit - budget.safety, budget.reserved)
    plan_budget = budget.budget if config.mode == "budget" else min(budget.budget, profile.peak)
    plan = plan_prefetch(profile, plan_budget, max_fuse_bytes=config.max_fuse_bytes, coalesce=config.coalesce)
    if not all_equal([plan.fingerprint(), len(plan.slots)], group, Tag("memory_plan.plan")):
        raise PlanError(
            f"hf_zero3 memory plan: ranks built different plans for graph {profile.graph_id} from agreed "
            f"inputs; refusing to run (the all-gathers would be reordered). Please report this."
        )
    return PlanRecord(profile, plan, budget)


def persists_at_compile(config: MemoryPlanConfig) -> bool:
    """Persistence is chosen from the profile at compile time: only without calibration."""
    return config.persist and config.mode == "budget" and config.calibrate_steps == 0


def is_last_backward(graph_id, graph_order) -> bool:
    # Backward runs graphs in reverse: the first forward graph needing backward is the last one.
    for g, needs_bwd in graph_order:
        if needs_bwd:
            return g == graph_id
    return False


def gathered_params(records: dict) -> tuple[dict, dict]:
    """(ds_id -> total profiled gather time, ds_id -> gathered bytes) over the planned graphs."""
    time_of, size_of = {}, {}
    for rec in records.values():
        for nd in rec.profile.nodes:
            if nd.kind == GATHER:
                time_of[nd.ds_id] = time_of.get(nd.ds_id, 0.0) + nd.time
                size_of[nd.ds_id] = nd.nbytes
    return time_of, size_of


def choose_persistent(
    records: dict, profiling_results: dict, group, budget: MemoryBudget, now: MemoryState
) -> tuple[tuple, dict]:
    """(parameter ids to keep gathered, their sizes): agreed, by benefit per byte within what the
    budget has left over every planned graph's peak and what is allocated ``now``."""
    peaks = [r.plan.peak for r in records.values()]
    for pr in profiling_results.values():  # graphs re-profiled after their plan
        peaks += profile_all_peaks(pr)
    tag = Tag("memory_plan.persist")
    peak = all_max([max(peaks, default=0), now.allocated], group, tag)  # the allocator's units
    time_of, size_of = gathered_params(records)
    chosen = plan_persistence([(d, size_of[d], time_of[d]) for d in sorted(size_of)], max(peak), budget.budget)
    if not all_equal([len(chosen), hash(chosen) & 0x7FFFFFFFFFFFFFFF], group, tag):
        raise PlanError("hf_zero3 memory plan: ranks chose different persistent parameters; refusing to run")
    return chosen, size_of


def persist(
    chosen: tuple,
    size_of: dict,
    group,
    memory: Callable[[], MemoryState],
    persist_fn: Callable | None = None,
) -> int | None:
    """Keep ``chosen`` gathered; returns their bytes, or None where nothing was made persistent.
    Each ``set_persistent`` is a collective: a rank that could not allocate one mid-way would leave
    the others in its all-gather, so the group first agrees that every rank can allocate them all
    (else none persists, on every rank alike)."""
    set_persistent = persist_fn or deepcompile_handle().set_persistent
    if persist_fn is None and torch.cuda.is_available():
        # Persistent buffers carved out of a cached block that a per-step temporary (the
        # optimizer's fp32 sub-group gradient) reuses every step would leave it no block to fit
        # in under a cap: hand free segments back first, so they go to fresh segments instead.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    need = sum(size_of[d] for d in chosen)
    (room,) = all_min([memory().allocatable - need], group, Tag("memory_plan.persist_fits"))
    if room < 0:
        log.warning(
            "hf_zero3 memory plan: a rank of the group cannot allocate the %.2f GiB chosen to stay "
            "gathered (short by %.2f GiB); nothing is made persistent",
            need / 2**30,
            -room / 2**30,
        )
        return None
    for ds_id in chosen:
        set_persistent(ds_id)
    log.info("hf_zero3 memory plan: %d parameters persistent (%.2f GiB)", len(chosen), need / 2**30)
    return need
