"""DeepCompile's profile of one graph, as the planner's :class:`GraphProfile`, agreed across ranks.

DeepCompile profiles every graph after each pass (``profiling_results[graph_id]``): per node its
device time (ms), the bytes allocated after it and the peak while it ran, and each gathered
parameter's size. Memory is measured per rank, so two ranks can see slightly different numbers;
:func:`agree_profile` takes the element-wise maximum over the gather group (one all-reduce), after
which every rank plans from the same input and builds the same plan.
"""

from __future__ import annotations

from dataclasses import replace

from torch.fx import Graph

from .._upstream import deepspeed as ds_up
from ..agree import Tag, all_equal, all_max
from .planner import COMPUTE, GATHER, INPUT, OUTPUT, RELEASE, WAIT, GraphProfile, NodeProfile, PlanError


def _dc_ops():
    kinds = {"gather": GATHER, "wait": WAIT, "release": RELEASE}
    return {op: kinds[kind] for op, kind in ds_up.dc_gather_ops().items()}


def node_kind(node, ops=None) -> str:
    if node.op == "placeholder":
        return INPUT
    if node.op == "output":
        return OUTPUT
    return (ops or {}).get(node.target, COMPUTE)


def _ds_id(node, kind) -> int:
    # allgather_param(param, graph_id, ds_id, dtype?); wait_allgather / release_param(t, graph_id, ds_id, ...)
    if kind in (GATHER, WAIT, RELEASE) and len(node.args) > 2 and isinstance(node.args[2], int):
        return int(node.args[2])
    return -1


def profile_meta_defaults() -> dict:
    return ds_up.profile_meta_defaults()


def profile_complete(prof, bwd: bool) -> bool:
    return ds_up.profile_complete(prof, bwd)


def profile_from_deepcompile(graph: Graph, prof, graph_id: int, bwd: bool, ops=None) -> GraphProfile:
    """Join ``graph``'s nodes with ``prof`` (a DeepCompile ``ProfilingResult``) by node name."""
    ops = ops if ops is not None else _dc_ops()
    _graph, mem, times, sizes = ds_up.profile_fields(prof, bwd)
    if not mem:
        raise PlanError(
            f"graph {graph_id} has no memory profile; DeepCompile did not profile it "
            f"(schedule the memory plan after 'zero3_compile' in the same step)"
        )
    mem_d = {name: (alloc, peak) for name, alloc, _delta, peak in mem}
    time_d = {name: float(dt) / 1e3 for name, dt, _wt in times}
    size_d = {name: int(sz) for name, sz in sizes}
    nodes = []
    alloc, peak = 0, 0
    for node in graph.nodes:
        if node.name in mem_d:  # nodes the profiler skipped inherit the previous values
            alloc, peak = (int(v) for v in mem_d[node.name])
        kind = node_kind(node, ops)
        nbytes = size_d.get(node.name, 0) if kind == GATHER else 0
        nodes.append(
            NodeProfile(
                node.name, kind, _ds_id(node, kind), nbytes, time_d.get(node.name, 0.0), max(peak, alloc), alloc
            )
        )
    return GraphProfile(graph_id, tuple(nodes), bwd)


def agree_profile(profile: GraphProfile, group=None) -> GraphProfile:
    """Element-wise maximum of peaks, allocations, sizes and times (ns) over ``group``."""
    tag = Tag("memory_plan.profile", {"graph": "bwd" if profile.bwd else "fwd"})
    n = len(profile.nodes)
    if not all_equal([n, sum(1 for x in profile.nodes if x.kind == GATHER)], group, tag):
        raise PlanError(
            f"graph {profile.graph_id}: ranks traced different graphs (node counts differ); "
            f"every rank of the gather group must compile the same model and inputs"
        )
    flat = []
    for x in profile.nodes:
        flat += [x.peak, x.alloc, x.nbytes, int(round(x.time * 1e9))]
    agreed = all_max(flat, group, tag)
    nodes = tuple(
        replace(x, peak=agreed[4 * i], alloc=agreed[4 * i + 1], nbytes=agreed[4 * i + 2], time=agreed[4 * i + 3] / 1e9)
        for i, x in enumerate(profile.nodes)
    )
    return replace(profile, nodes=nodes)
