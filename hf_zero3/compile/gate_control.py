"""The run-time gate's side of the pass: its ops placed in the planned graph, its budgets set.

:func:`rewrite` inserts one ``hf_zero3::agree_launch`` before a graph's first planned prefetch
and one ``hf_zero3::gated_prefetch`` per slot (DeepCompile's plain fused prefetch with the gate
off); :func:`set_gates` sets every planned graph's gate from the calibration's agreed state
(:mod:`.calibration`), so every rank's launches carry the same budget.
"""

from __future__ import annotations

import torch

from .._upstream.deepspeed import dc_prefetch_op
from . import gate as gate_ops
from .calibration import Calibration
from .planner import GraphProfile, PlanError, PrefetchPlan
from .profile import profile_meta_defaults


def rewrite(
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
    nodes = list(gm.graph.nodes)
    if len(nodes) != len(profile.nodes) or any(n.name != p.name for n, p in zip(nodes, profile.nodes)):
        raise PlanError(f"graph {graph_id} changed between profiling and planning; cannot place prefetches")
    launch = None
    if gate:
        gate_ops.register_ops()
        gate_ops.set_launch_group(graph_id, group)
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
                new = gm.graph.call_function(dc_prefetch_op(), (graph_id, params, list(slot.ds_ids)))
        _profile_meta(new)
    gm.graph.lint()


def _profile_meta(node) -> None:
    # DeepCompile's profiler treats nodes without its metadata keys as unprofiled.
    for key, default in profile_meta_defaults().items():
        node.meta.setdefault(key, default)


def set_gates(records: dict, calibration: Calibration, mode: str) -> None:
    """Every planned graph's gate: lowered by the calibration's ``tighten``, and no higher than its
    profiled peak plus the measured headroom (while calibrating in budget mode: plus nothing)."""
    for key, rec in records.items():
        if calibration.decision is None:
            cap = rec.profile.peak if calibration.calibrating and mode == "budget" else None
        else:
            cap = rec.profile.peak + calibration.decision.headroom
        gate_ops.set_adjust(key, cap, calibration.tighten)
