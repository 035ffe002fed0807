"""The memory-budgeted prefetch and persistence planner: pure functions of a profile and a budget.

DeepSpeed's own passes (``prefetch`` then ``selective_gather``) each budget against 90% of the
card, separately, and ignore the process's real limit. Here one budget governs both, and the
plan is a deterministic function of (profile, budget) so that ranks holding the same agreed
inputs build the same plan, byte for byte (see :meth:`PrefetchPlan.fingerprint`).

Rules, chosen so the properties the tests check hold by construction:

* **Never over budget.** ``projected[k] = peak[k] + extra[k]`` where ``extra`` counts the
  prefetched bytes in flight over node ``k``; every placement is checked against it.
* **Monotone.** Candidates are ranked once (profiled gather time per byte, best first, ties by
  position). Each is admitted iff its minimal footprint fits on top of the footprints of *all*
  candidates ranked before it, admitted or not. That test does not depend on other admissions,
  so a larger budget keeps every admission and may add more: never fewer prefetches. Distances
  are extended afterwards, which changes no count.
* **Few launches.** Fused groups are then merged into the group before them while the earlier
  issue fits (``coalesce``): fewer, larger all-gathers, as DeepSpeed's prefetch pass fuses.
* **Benefit per byte.** Persistence (a parameter kept gathered for the whole step) goes to the
  parameters with the most gather time saved per byte, as the longest prefix that fits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

INPUT, GATHER, WAIT, RELEASE, COMPUTE, OUTPUT = "input", "gather", "wait", "release", "compute", "output"


class PlanError(ValueError):
    """A profile the planner cannot plan (malformed, or not from a ZeRO-3 graph)."""


class BudgetTooSmallError(PlanError):
    """The budget is below what the graph needs even with no prefetch at all."""


@dataclass(frozen=True)
class NodeProfile:
    """One node of a profiled graph, in program order.

    ``peak`` is the allocator's peak while the node ran (absolute bytes, as DeepCompile's memory
    profiler records it); ``nbytes`` the gathered size of a ``gather`` node; ``time`` its profiled
    device time in seconds; ``alloc`` the bytes allocated after the node.
    """

    name: str
    kind: str = COMPUTE
    ds_id: int = -1
    nbytes: int = 0
    time: float = 0.0
    peak: int = 0
    alloc: int = 0


@dataclass(frozen=True)
class GraphProfile:
    graph_id: int
    nodes: tuple[NodeProfile, ...]
    bwd: bool = False

    @property
    def peak(self) -> int:
        return max((n.peak for n in self.nodes), default=0)

    def gathers(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.kind == GATHER]

    def to_json(self) -> dict:
        """Plain data (``from_json`` inverts it); ``HF_ZERO3_PLAN_DUMP`` writes DeepCompile's this way."""
        return {
            "graph_id": self.graph_id,
            "bwd": self.bwd,
            "nodes": [[n.name, n.kind, n.ds_id, n.nbytes, n.time, n.peak, n.alloc] for n in self.nodes],
        }

    @classmethod
    def from_json(cls, data: dict) -> "GraphProfile":
        return cls(int(data["graph_id"]), tuple(NodeProfile(*row) for row in data["nodes"]), bool(data["bwd"]))


@dataclass(frozen=True)
class PrefetchSlot:
    """One fused prefetch, issued just before node ``index``.

    ``window_peak`` is the highest projected live memory while its parameters are in flight: the
    runtime gate compares it (plus the drift it measures) with the agreed headroom.
    """

    index: int
    ds_ids: tuple[int, ...]
    gather_nodes: tuple[int, ...]
    nbytes: int
    window_peak: int


@dataclass(frozen=True)
class PrefetchPlan:
    graph_id: int
    budget: int
    slots: tuple[PrefetchSlot, ...]
    projected: tuple[int, ...]
    hidden_time: float
    candidates: int
    skipped: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def prefetched(self) -> int:
        return sum(len(s.ds_ids) for s in self.slots)

    @property
    def peak(self) -> int:
        return max(self.projected, default=0)

    def fingerprint(self) -> int:
        """63-bit digest of everything that decides collectives (order, members, sizes)."""
        h = hashlib.blake2b(digest_size=8)
        for s in self.slots:
            h.update(repr((s.index, s.ds_ids, s.nbytes, s.window_peak)).encode())
        return int.from_bytes(h.digest(), "little") >> 1


def _check(profile: GraphProfile) -> None:
    seen_compute = False
    for n in profile.nodes:
        if n.kind not in (INPUT, GATHER, WAIT, RELEASE, COMPUTE, OUTPUT):
            raise PlanError(f"node {n.name!r} has unknown kind {n.kind!r}")
        if n.kind == GATHER and (n.ds_id < 0 or n.nbytes <= 0):
            raise PlanError(
                f"gather node {n.name!r} needs a ds_id and a positive size "
                f"(got ds_id={n.ds_id}, nbytes={n.nbytes}); was the graph profiled?"
            )
        if n.peak < 0 or n.time < 0:
            raise PlanError(f"node {n.name!r} has a negative profile value")
        seen_compute |= n.kind != INPUT
    if not seen_compute:
        raise PlanError(f"graph {profile.graph_id} has no nodes to plan")


def _min_issue(nodes: Sequence[NodeProfile], u: int, floor: int) -> int | None:
    """Issue point of the smallest useful prefetch of gather ``u``: before the nearest compute
    node above it (anything less overlaps no compute). None when there is none above ``floor``."""
    k = u - 1
    while k >= floor and nodes[k].kind != COMPUTE:
        k -= 1
    return k if k >= floor else None


def plan_prefetch(
    profile: GraphProfile,
    budget: int,
    *,
    max_fuse_bytes: int = 1 << 30,
    cover: float = 1.0,
    exclude: Iterable[int] = (),
    coalesce: bool = True,
) -> PrefetchPlan:
    """Place prefetches for ``profile``'s gathers so that projected memory stays <= ``budget``.

    A node whose profiled peak is already above the budget hosts no prefetch (the profile of an
    uncompiled graph over-estimates the compiled one, so this is not an error by itself; see
    :func:`check_floor`). ``cover``: how much of a gather's profiled time the compute between
    issue and use should hide before the planner stops moving it earlier. ``exclude``: ds_ids that
    need no prefetch (persistent ones). ``coalesce``: merge each slot into the one before it
    while the earlier issue still fits the budget (see :func:`_coalesce`).
    """
    _check(profile)
    nodes = profile.nodes
    n = len(nodes)
    budget = int(budget)
    base = [nd.peak for nd in nodes]
    exclude = set(exclude)
    first = next(i for i, nd in enumerate(nodes) if nd.kind != INPUT)

    # Where each gather may be issued from: after the last node touching the same parameter.
    last_touch: dict[int, int] = {}
    floors: dict[int, int] = {}
    for i, nd in enumerate(nodes):
        if nd.kind in (GATHER, WAIT, RELEASE) and nd.ds_id >= 0:
            if nd.kind == GATHER:
                floors[i] = max(first, last_touch.get(nd.ds_id, -1) + 1)
            last_touch[nd.ds_id] = i

    cands = []
    skipped = {"persistent": 0, "no_compute_above": 0, "over_budget": 0}
    for u in profile.gathers():
        nd = nodes[u]
        if nd.ds_id in exclude:
            skipped["persistent"] += 1
            continue
        p0 = _min_issue(nodes, u, floors[u])
        if p0 is None:
            skipped["no_compute_above"] += 1
            continue
        cands.append((-(nd.time / nd.nbytes), u, p0))
    cands.sort()

    # Admission: every candidate ranked earlier holds its minimal footprint in `reserved` whether
    # it was admitted or not, so a candidate's admission depends on the budget alone (monotone).
    reserved = [0] * n
    extra = [0] * n
    admitted: list[tuple[int, int]] = []  # (gather index, issue index)
    for _, u, p0 in cands:
        s = nodes[u].nbytes
        fits = all(base[k] + reserved[k] + s <= budget for k in range(p0, u))
        for k in range(p0, u):
            reserved[k] += s
            extra[k] += s if fits else 0
        if fits:
            admitted.append((u, p0))
        else:
            skipped["over_budget"] += 1

    # Extend each admitted prefetch earlier until its gather time is covered, in ranking order.
    hidden = 0.0
    placed: dict[int, int] = {}
    for u, p in admitted:
        nd = nodes[u]
        need = nd.time * cover
        covered = sum(nodes[k].time for k in range(p, u) if nodes[k].kind == COMPUTE)
        while covered < need and p - 1 >= floors[u] and base[p - 1] + extra[p - 1] + nd.nbytes <= budget:
            p -= 1
            extra[p] += nd.nbytes
            if nodes[p].kind == COMPUTE:
                covered += nodes[p].time
        placed[u] = p
        hidden += min(covered, nd.time)

    # Fuse prefetches issued at the same point (program order of their gathers), capped in size.
    by_issue: dict[int, list[int]] = {}
    for u in sorted(placed):
        by_issue.setdefault(placed[u], []).append(u)
    groups: list[tuple[int, list[int]]] = []  # (issue index, gather indices)
    for p in sorted(by_issue):
        group: list[int] = []
        for u in by_issue[p] + [None]:
            if u is not None and (not group or sum(nodes[g].nbytes for g in group) + nodes[u].nbytes <= max_fuse_bytes):
                group.append(u)
                continue
            if group:
                groups.append((p, group))
            group = [u] if u is not None else []
    if coalesce:
        groups = _coalesce(groups, nodes, floors, base, extra, budget, max_fuse_bytes)
    projected = [base[k] + extra[k] for k in range(n)]
    slots = tuple(
        PrefetchSlot(
            index=p,
            ds_ids=tuple(nodes[g].ds_id for g in group),
            gather_nodes=tuple(group),
            nbytes=sum(nodes[g].nbytes for g in group),
            window_peak=max(projected[p : max(group)]),
        )
        for p, group in groups
    )
    assert all(e == 0 or p <= budget for e, p in zip(extra, projected)), "planner invariant: over budget"
    return PrefetchPlan(
        graph_id=profile.graph_id,
        budget=budget,
        slots=tuple(slots),
        projected=tuple(projected),
        hidden_time=hidden,
        candidates=len(cands),
        skipped=skipped,
    )


def _coalesce(
    groups: list[tuple[int, list[int]]],
    nodes: Sequence[NodeProfile],
    floors: dict[int, int],
    base: list[int],
    extra: list[int],
    budget: int,
    max_fuse_bytes: int,
) -> list[tuple[int, list[int]]]:
    """Merge each fused group into the previous one (issued earlier) while that fits.

    Every fused prefetch is one collective launch plus its host-side bookkeeping, and a compiled
    ZeRO-3 step of a small model is bound by the host, not the GPU: a plan of ~100 small slots per
    graph costs more than the gathers it hides. A group moves up to the previous group's issue
    point when the bytes it then holds longer fit the budget at every node in between, the merged
    size stays within ``max_fuse_bytes``, and no gather would be issued before the previous touch
    of its own parameter. Counts and members are unchanged, only issue points move (updating
    ``extra``), so the budget and monotonicity properties still hold.
    """
    out: list[tuple[int, list[int]]] = []
    for q, group in groups:
        if out:
            p, cur = out[-1]
            size = sum(nodes[u].nbytes for u in group)
            if (
                sum(nodes[u].nbytes for u in cur) + size <= max_fuse_bytes
                and all(floors[u] <= p for u in group)
                and all(base[k] + extra[k] + size <= budget for k in range(p, q))
            ):
                for k in range(p, q):
                    extra[k] += size
                cur.extend(group)
                cur.sort()
                continue
        out.append((q, list(group)))
    return out


def check_floor(profile: GraphProfile, limit: int, reserved: int = 0) -> None:
    """Raise :class:`BudgetTooSmallError` when memory the graph holds at every node (its lowest
    allocation: weights' shards, gradients, optimizer state) plus ``reserved`` exceeds ``limit``:
    no schedule can fit then."""
    floor = min((n.alloc for n in profile.nodes if n.kind != INPUT), default=0)
    if floor + reserved > limit:
        raise BudgetTooSmallError(
            f"graph {profile.graph_id} ({'backward' if profile.bwd else 'forward'}) holds {_gib(floor)} at every "
            f"node (with no prefetch at all), plus {_gib(reserved)} the optimizer allocates later, above the memory "
            f"limit of {_gib(limit)}. Raise the limit (hf_zero3.memory_plan.max_memory or the per-process memory "
            f"fraction), or shrink what stays resident: DeepSpeed optimizer/parameter offload, more ranks."
        )


def plan_persistence(candidates: Iterable[tuple[int, int, float]], peak: int, budget: int) -> tuple[int, ...]:
    """Parameters to keep gathered for the whole step: ``candidates`` are (ds_id, bytes, total
    profiled gather time). They go by gather time saved per byte, best first, as the longest
    prefix with ``peak + persisted bytes <= budget`` (``peak``: the highest projected memory of
    any planned graph, which every persistent byte adds to)."""
    ranked = sorted((c for c in candidates if c[1] > 0), key=lambda c: (-(c[2] / c[1]), c[0]))
    room = int(budget) - int(peak)
    chosen = []
    for ds_id, nbytes, _ in ranked:
        if nbytes > room:
            break
        room -= nbytes
        chosen.append(int(ds_id))
    return tuple(chosen)


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"
