"""What the memory plan tells its user: each planned graph in the log (and, with
``HF_ZERO3_PLAN_DUMP=<dir>``, as JSON), and the summary of a compile cycle's plans."""

from __future__ import annotations

import json
import logging
import os

import torch

from .budget import MemoryBudget
from .calibration import Calibration
from .graph_plan import PlanRecord
from .planner import GraphProfile, PrefetchPlan

log = logging.getLogger("hf_zero3.memory_plan")


def planned(graph_id: int, bwd: bool, record: PlanRecord) -> None:
    """A graph was rewritten with its plan: dump it and log what was placed."""
    profile, plan, budget = record.profile, record.plan, record.budget
    dump(profile, plan, budget)
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


def dump(profile: GraphProfile, plan: PrefetchPlan, budget: MemoryBudget) -> None:
    """With HF_ZERO3_PLAN_DUMP=<dir>, rank 0 writes each agreed profile and its plan as JSON."""
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


def summary(records: dict, persistent: tuple, persistent_bytes: int, calibration: Calibration) -> dict:
    """The plans of one compile cycle, summed over its graphs."""
    return {
        "graphs": len(records),
        "prefetched": sum(r.plan.prefetched for r in records.values()),
        "gathers": sum(len(r.profile.gathers()) for r in records.values()),
        "slots": sum(len(r.plan.slots) for r in records.values()),
        "projected_peak": max((r.plan.peak for r in records.values()), default=0),
        "budget": min((r.budget.budget for r in records.values()), default=0),
        "persistent": len(persistent),
        "persistent_bytes": persistent_bytes,
        "calibrated": calibration.decision is not None,
        "gate_tighten": calibration.tighten,
    }
