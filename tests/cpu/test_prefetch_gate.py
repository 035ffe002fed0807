"""The run-time prefetch gate: its decision, its agreement across real gloo ranks, and the native
build (csrc/gate.cpp) deciding as the PyTorch fallback does.

The multi-rank tests run the *rewritten* FX graph of a real Llama (the planner's pass applied,
``hf_zero3::agree_launch`` and ``hf_zero3::gated_prefetch`` dispatched through torch.ops), with
each rank reporting a different memory state. Every issued prefetch is a real gloo all-reduce, so
ranks that disagreed would issue different collectives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from hf_zero3.compile.gate import MemoryState, decide
from hf_zero3.testing import DistributedFailure, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decision_is_a_pure_function_of_the_agreed_launch():
    assert decide(90, [10, 100]) and not decide(91, [10, 100])
    assert decide(120, [-20, 100])  # memory below the profile makes room
    window_peaks = [50, 80, 95]
    assert [decide(wp, [0, 100]) for wp in window_peaks] == [True, True, True]
    assert [decide(wp, [10, 100]) for wp in window_peaks] == [True, True, False]
    assert [decide(wp, [60, 100]) for wp in window_peaks] == [False, False, False]


def test_drift_is_measured_in_allocator_units():
    from hf_zero3.compile.gate import local_drift

    s = MemoryState(allocated=700, reserved=800, free=100, total=1000)
    assert s.non_pytorch == 100 and s.fragmentation == 100
    assert local_drift(0, ref_alloc=600, state=s) == 700 - 600
    # another process taking memory on the card moves nothing the gate compares
    crowded = MemoryState(allocated=700, reserved=800, free=0, total=1000)
    assert local_drift(0, ref_alloc=600, state=crowded) == 700 - 600


def test_allocatable_counts_cached_blocks_and_the_fraction_cap():
    # What eval gathering (gathering.free_bytes) may still allocate, from the same reading the gate uses.
    s = MemoryState(allocated=700, reserved=800, free=100, total=1000)
    assert s.allocatable == 100 + 100  # device free + cached but unallocated
    capped = MemoryState(allocated=700, reserved=800, free=100, total=1000, fraction=0.75)
    assert capped.allocatable == 750 - 700  # the cap binds before the device does
    assert MemoryState(allocated=900, reserved=900, free=50, total=1000, fraction=0.5).allocatable == 0


def _gated_graph_rank(agree: bool, drifts: tuple[int, ...]):
    """Plan + rewrite a recorded Llama graph, run it with this rank's memory state, log issues."""
    import torch.distributed as dist
    from fixtures.fx_profile import STAND_IN_OPS, record_tiny_model
    from torch.fx import Interpreter

    from hf_zero3.compile import gate
    from hf_zero3.compile.gate_control import rewrite
    from hf_zero3.compile.planner import plan_prefetch
    from hf_zero3.compile.profile import agree_profile, profile_from_deepcompile
    from hf_zero3.testing import mark

    rank = dist.get_rank()
    rec = record_tiny_model()
    with torch.no_grad():
        reference = Interpreter(rec.gm).run(*rec.inputs)
    profile = agree_profile(profile_from_deepcompile(rec.fwd_graph, rec, 0, False, ops=STAND_IN_OPS))
    budget = profile.peak * 2
    plan = plan_prefetch(profile, budget, coalesce=False)  # many slots: many gate decisions to compare
    # Without agreement each rank "agrees" with itself only (a one-rank group per rank).
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    group = None if agree else solo[rank]
    gate.register_ops()
    rewrite(rec.gm, profile, plan, graph_id=0, gate_budget=budget, gate=True, group=group)
    first = plan.slots[0]
    ref_alloc = profile.nodes[first.index - 1].alloc
    gate.set_launch_group(0, group, state_fn=lambda: MemoryState(ref_alloc + drifts[rank], 0, 0, 0))
    issued = []

    def issue(graph_id, params, ids):  # a real collective per issued prefetch
        t = torch.tensor([float(sum(ids) + 1)])
        dist.all_reduce(t)
        issued.append((tuple(ids), float(t.item()) == 2.0 * (sum(ids) + 1)))

    gate.set_issue_fn(issue)
    gate.reset_counters()
    mark("running the gated graph")
    with torch.no_grad():
        out = Interpreter(rec.gm).run(*rec.inputs)
    gate.set_issue_fn(None)
    names = [n.target for n in rec.gm.graph.nodes if n.op == "call_function"]
    return dict(
        rank=rank,
        issued=issued,
        counters=gate.counters(),
        same_output=torch.equal(out, reference),
        slots=len(plan.slots),
        window_peaks=[s.window_peak for s in plan.slots],
        budget=budget,
        inserted=sum(1 for t in names if "gated_prefetch" in str(t)),
        launches=sum(1 for t in names if "agree_launch" in str(t)),
    )


def _split_drift(plan_peaks, budget):
    """A drift that lets the smallest window through and defers the largest."""
    lo, hi = min(plan_peaks), max(plan_peaks)
    assert hi > lo, "need windows of different heights"
    return budget - (lo + hi) // 2


def test_agreed_gate_takes_identical_decisions_on_every_rank():
    # Probe the plan's window peaks once (rank-independent) to pick drifts that split it.
    probe = run_ranks(_gated_graph_rank, 2, args=(True, (0, 0)), timeout=240, pg_timeout=60)[0]
    assert probe["inserted"] == probe["slots"] > 1 and probe["launches"] == 1
    assert probe["counters"]["deferred"] == 0 and probe["counters"]["issued"] == probe["slots"]
    split = _split_drift(probe["window_peaks"], probe["budget"])
    r0, r1 = run_ranks(_gated_graph_rank, 2, args=(True, (0, split)), timeout=240, pg_timeout=60)
    assert r0["issued"] == r1["issued"], "ranks issued different prefetches"
    assert all(ok for _, ok in r0["issued"])
    assert r0["counters"] == r1["counters"]
    assert 0 < r0["counters"]["deferred"] < r0["slots"]  # the larger drift (rank 1's) governs both
    assert r0["same_output"] and r1["same_output"]  # gating never changes the result


def test_rank_local_decisions_break_the_group():
    """The negative control: the same drifts without agreement issue different collectives."""
    probe = run_ranks(_gated_graph_rank, 2, args=(True, (0, 0)), timeout=240, pg_timeout=60)[0]
    split = _split_drift(probe["window_peaks"], probe["budget"])
    try:
        r0, r1 = run_ranks(_gated_graph_rank, 2, args=(False, (0, split)), timeout=120, pg_timeout=15)
    except DistributedFailure as exc:  # a rank waited on a collective its peer never issued
        assert any(r.outcome != "ok" for r in exc.reports)
        return
    assert r0["counters"] != r1["counters"] or not all(ok for _, ok in r0["issued"] + r1["issued"])


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build csrc/gate.cpp"
)
def test_native_gate_builds_and_decides_like_the_fallback():
    code = r"""
import torch, hf_zero3.native_gate as ext
from hf_zero3.compile import gate
mod = ext.load()
assert mod is not None, ext.unavailable_reason()
assert not mod.built_with_cuda()
grid = [(wp, d, b) for wp in (0, 50, 99, 100, 101, 10**12) for d in (-10, 0, 1, 60) for b in (0, 100, 10**12)]
assert all(mod.decide(wp, torch.tensor([d, b])) == gate.decide(wp, [d, b]) for wp, d, b in grid)
gate.register_ops()  # agree_launch from Python; gated_prefetch stays the native one
mod.reset_counters()
p = torch.zeros(4)
torch.ops.hf_zero3.gated_prefetch(7, [p], [3], 16, 200, torch.tensor([0, 100]))  # defer: no collective
c = mod.counters()
assert c["deferred"] == 1 and c["deferred_bytes"] == 16 and c["issued"] == 0, c
assert gate.counters() == c
try:  # an issued prefetch is DeepCompile's fused all-gather, absent on CPU
    torch.ops.hf_zero3.gated_prefetch(7, [p], [3], 16, 50, torch.tensor([0, 100]))
    raise SystemExit("expected the dc op to be missing on CPU")
except RuntimeError as exc:
    assert "dc::prefetch_params_fused" in str(exc), exc
print("NATIVE_OK")
"""
    env = dict(os.environ, HF_ZERO3_NATIVE="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert "NATIVE_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
