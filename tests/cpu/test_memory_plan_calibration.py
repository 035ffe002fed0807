"""The memory plan's calibration (``hf_zero3.compile.calibration``): the plan stays at match_zero3's
level until real steps were measured, then lowers its gate by the measured excess and persists only
within the measured room, on every rank alike. Driven on the recorded FX graph of a real Llama over
two gloo ranks whose measured peaks differ; persistence issues a real collective per parameter (as
DeepCompile's ``set_persistent`` all-gathers), so ranks that decided differently break the group."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_zero3.testing import DistributedFailure, run_ranks


def test_decision_tightens_by_the_measured_excess_and_persists_within_the_room():
    from hf_zero3.compile.calibration import decide

    cands = [(1, 100, 1.0), (2, 100, 3.0), (3, 400, 2.0)]  # best per byte: 2, then 1, then 3
    d = decide(peak_fwd_bwd=1_000, peak_step=1_050, projected=900, gate_budget=1_300, candidates=cands, persist=True)
    assert d.excess == 100 and d.tighten == 100
    assert d.room == 250 and d.persistent == (2, 1)  # 3 (400 B) does not fit in what is left
    # The compiled step below the profile's forecast: the gate is not loosened, only never tightened.
    d = decide(800, 800, 900, 1_400, cands, True)
    assert d.tighten == 0 and d.excess == -100 and d.persistent == (2, 1, 3)
    # No room (the real step already reaches the gate budget): nothing persistent, gate lowered.
    d = decide(1_400, 1_500, 900, 1_300, cands, True)
    assert d.persistent == () and d.tighten == 500
    assert decide(1_000, 1_000, 0, 1_300, cands, False) == decide(1_000, 1_000, 0, 1_300, [], False)


def test_fragmentation_under_a_cap_lowers_the_gate_and_the_room():
    from hf_zero3.compile.calibration import decide

    cands = [(1, 100, 1.0), (2, 100, 3.0), (3, 400, 2.0)]
    # 2 GiB-style: the step peaked at 1_000 allocated but 1_600 reserved (fragmented cache), 100 planned for
    d = decide(
        1_000, 1_000, 900, 2_000, cands, True, peak_reserved=1_300, reserved_limit=1_800, planned_fragmentation=100
    )
    assert d.tighten == 100 + 200  # the excess, plus fragmentation beyond the planned
    # reserved headroom (500) less the measured fragmentation (300), not allocated headroom (1000), binds
    assert d.room == 200 and d.persistent == (2, 1)
    assert d.headroom == 0  # the room went to persistence: prefetches stay at the profiled peaks
    d = decide(1_000, 1_000, 900, 2_000, cands, True, peak_reserved=1_500, reserved_limit=1_800)
    assert d.room == -200 and d.persistent == () and d.headroom == 0  # tight: match_zero3's level
    d = decide(1_000, 1_000, 900, 2_000, cands, False, peak_reserved=1_100, reserved_limit=1_800)
    assert d.persistent == () and d.headroom == 600  # persistence off: all room to prefetches


def test_decision_is_monotone_in_the_measured_peak():
    from hf_zero3.compile.calibration import decide

    cands = [(i, 10 * (i % 7 + 1), float(i % 5 + 1)) for i in range(40)]
    previous = None
    for peak in range(0, 2_000, 50):  # a higher real peak never persists more nor gates less
        d = decide(peak, peak, 500, 1_800, cands, True)
        if previous is not None:
            assert set(d.persistent) <= set(previous.persistent) and d.tighten >= previous.tighten
        previous = d


def _calibrating_rank(
    agree: bool,
    extra_peak: tuple[int, ...],
    slack: int = 60_000,
    jump: int = 0,
    persist: bool = True,
    squeeze_rank: int | None = None,
):
    """Plan, run the gated graph while calibrating, report 2 measured steps (this rank's peak is
    the profile's plus ``extra_peak[rank]``), run it again twice, rank 1 peaking ``jump`` bytes
    higher at the last step. ``agree=False``: the planner's group is this rank alone, so it decides
    from its own peaks (the negative control)."""
    import torch.distributed as dist
    from fixtures.fx_profile import STAND_IN_OPS, collective_issue, record_tiny_backward
    from torch.fx import Interpreter

    from hf_zero3.compile import MemoryPlanConfig, gate
    from hf_zero3.compile.gate import MemoryState
    from hf_zero3.compile.memory_plan import MemoryPlanPass
    from hf_zero3.testing import mark

    rank, gid = dist.get_rank(), 17
    rec = record_tiny_backward()
    with torch.no_grad():
        reference = Interpreter(rec.gm).run(*rec.inputs)
    peak = max(m[3] for m in rec.fwd_mem)
    total = peak + slack
    state = MemoryState(allocated=peak // 2, reserved=peak // 2 + 1000, free=total - peak // 2 - 1000, total=total)
    memory = {"now": state}
    persisted = []

    def persist_one(ds_id):  # a real collective per persistent parameter, as set_persistent all-gathers
        t = torch.tensor([float(ds_id + 1)])
        dist.all_reduce(t)
        persisted.append((ds_id, float(t.item()) == 2.0 * (ds_id + 1)))

    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    group = None if agree else solo[rank]
    measured = {"fb": peak + extra_peak[rank], "st": peak + extra_peak[rank] + 500}
    plan_pass = MemoryPlanPass(
        MemoryPlanConfig(safety_margin=0.0, calibrate_steps=2, persist=persist),
        ops=STAND_IN_OPS,
        read_memory=lambda: memory["now"],
        persist_fn=persist_one,
        read_peaks=lambda: (measured["fb"], measured["st"], measured["st"] + 1000),
        runtime=SimpleNamespace(group=group),
    )
    gate.reset_drifts()
    out_gm = plan_pass(rec.gm, gid, [(gid, True)], {gid: rec}, None, 0.0, None, True)
    assert out_gm is not None, plan_pass.error
    slots = len(plan_pass.records[(gid, True)].plan.slots)
    windows = [s.window_peak for s in plan_pass.records[(gid, True)].plan.slots]
    rec0 = plan_pass.records[(gid, True)]
    ref_alloc = rec0.profile.nodes[rec0.plan.slots[0].index - 1].alloc
    run_state = MemoryState(allocated=ref_alloc, reserved=0, free=total, total=total)  # drift 0: as profiled
    gate.set_launch_group(gid, group, state_fn=lambda: run_state)
    issued = []
    gate.set_issue_fn(collective_issue(issued))
    runs = []
    decisions = []
    if rank == squeeze_rank:  # after planning, this rank's card fills up (another process, a leak)
        memory["now"] = MemoryState(allocated=peak // 2, reserved=peak // 2, free=0, total=total)
    for step in range(5):  # step 0 compiled (skipped), 1-2 measured, 3-4 run calibrated
        mark(f"step {step}")
        if step == 4 and rank == 1:  # rank 1 alone peaks higher (a longer batch, a leak)
            measured["fb"] += jump
        before = len(issued)
        with torch.no_grad():
            out = Interpreter(out_gm).run(*rec.inputs)
        runs.append(dict(issued=len(issued) - before, same=torch.equal(out, reference)))
        decisions.append(plan_pass.after_step())
    gate.set_issue_fn(None)
    d = plan_pass.calibration.decision
    return dict(
        rank=rank,
        runs=runs,
        slots=slots,
        windows=windows,
        profile_peak=plan_pass.records[(gid, True)].profile.peak,
        persisted=persisted,
        decision=None if d is None else (d.tighten, d.persistent, d.room, d.excess),
        decided_at=[i for i, x in enumerate(decisions) if x is not None],
        history=plan_pass.calibration.history,
        summary=plan_pass.summary(),
        gate_budget=plan_pass.records[(gid, True)].budget.gate_budget,
        reserved_room=(
            plan_pass.records[(gid, True)].budget.limit
            - plan_pass.records[(gid, True)].budget.safety
            - (peak + 20_000 + 500 + 1000)
            - 1000
        ),
    )


def test_calibration_decides_identically_on_every_rank_from_the_agreed_peaks():
    # rank 1's real step peaks 20 KB above rank 0's: both decide from rank 1's (the group maximum)
    r0, r1 = run_ranks(_calibrating_rank, 2, args=(True, (0, 20_000)), timeout=240, pg_timeout=60)
    for r in (r0, r1):
        assert r["decided_at"] == [2], r["decided_at"]  # after the compile step and 2 measured steps
        assert all(run["same"] for run in r["runs"])  # gating and persistence never change the result
        assert all(ok for _, ok in r["persisted"])
        # while calibrating, no prefetch raised the graph above its own profiled peak (+ drift <= 0)
        assert r["runs"][0]["issued"] == r["runs"][1]["issued"] == r["runs"][2]["issued"]
        assert r["runs"][3]["issued"] >= r["runs"][0]["issued"]
    assert r0["decision"] == r1["decision"] and r0["persisted"] == r1["persisted"]
    assert r0["history"] == r1["history"] and r0["summary"] == r1["summary"]
    tighten, persistent, room, excess = r0["decision"]
    # the tighter rank's peak decides; 1000 B cached-but-free memory (the recorded state's) was planned for
    assert room == min(r0["gate_budget"] - (r0["profile_peak"] + 20_000 + 500), r0["reserved_room"])
    assert tighten == max(0, excess)
    assert 0 < len(persistent) < r0["summary"]["gathers"]
    assert r0["summary"]["calibrated"]


def test_a_rank_that_cannot_allocate_the_persistent_parameters_stops_every_rank_persisting():
    # rank 1 has no free memory left when the decision is acted on: each set_persistent is a
    # collective, so the group agrees first, and no rank persists (instead of rank 1 failing in
    # one of them while rank 0 waits in the next)
    r0, r1 = run_ranks(_calibrating_rank, 2, args=(True, (0, 20_000), 60_000, 0, True, 1), timeout=240, pg_timeout=60)
    assert r0["decision"] == r1["decision"] and r0["decision"][1]  # the agreed decision chose some
    assert r0["persisted"] == r1["persisted"] == []
    assert r0["summary"]["persistent"] == r1["summary"]["persistent"] == 0
    assert all(run["same"] for r in (r0, r1) for run in r["runs"])


def test_measured_room_lets_prefetches_through_and_an_overshoot_lowers_every_gate():
    # persist=False: all of the measured room goes to prefetches
    r0, r1 = run_ranks(
        _calibrating_rank, 2, args=(True, (0, 20_000), 200_000, 250_000, False), timeout=240, pg_timeout=60
    )
    tighten, persistent, room, excess = r0["decision"]
    assert excess == 20_000 and tighten == 20_000  # drift 0: the excess is rank 1's extra peak
    assert not persistent and room > 0
    for r in (r0, r1):
        assert r["runs"][0]["issued"] == 0 < r["runs"][3]["issued"]  # match level, then the headroom
        assert all(run["same"] for run in r["runs"])
    # the watch: rank 1 alone overshoots at step 4 while prefetches were issued: both gates lower alike
    assert r0["history"] == r1["history"]
    assert r0["history"][-1][3] > r0["history"][-2][3] == tighten
    assert r0["summary"]["gate_tighten"] == r0["history"][-1][3]


def test_a_rank_local_calibration_breaks_the_group():
    """The negative control: each rank calibrates from its own peak, persists a different set of
    parameters, and the collectives DeepCompile issues for them no longer match."""
    try:
        r0, r1 = run_ranks(_calibrating_rank, 2, args=(False, (0, 20_000)), timeout=120, pg_timeout=15)
    except DistributedFailure as exc:  # a rank waited on a collective its peer never issued
        assert any(r.outcome != "ok" for r in exc.reports)
        return
    assert r0["persisted"] != r1["persisted"] or not all(ok for _, ok in r0["persisted"] + r1["persisted"])


def _planned_pass(gid: int):
    """A pass that planned the recorded graph (graph ``gid``), every rank reading the same memory
    and peaks (the world group agrees)."""
    from fixtures.fx_profile import STAND_IN_OPS, record_tiny_backward

    from hf_zero3.compile import MemoryPlanConfig
    from hf_zero3.compile.gate import MemoryState
    from hf_zero3.compile.memory_plan import MemoryPlanPass

    rec = record_tiny_backward()
    peak = max(m[3] for m in rec.fwd_mem)
    state = MemoryState(allocated=peak // 2, reserved=peak // 2, free=10 * peak, total=11 * peak)
    plan_pass = MemoryPlanPass(
        MemoryPlanConfig(safety_margin=0.0, calibrate_steps=2),
        ops=STAND_IN_OPS,
        read_memory=lambda: state,
        persist_fn=lambda ds_id: None,
        read_peaks=lambda: (peak, peak, peak),
        runtime=SimpleNamespace(group=None),
    )
    assert plan_pass(rec.gm, gid, [(gid, True)], {gid: rec}, None, 0.0, None, True) is not None
    return plan_pass


def _accumulation_and_failure_rank():
    """Micro-steps inside an accumulation cycle take no agreement (rank 0 runs 3 of them, rank 1
    one: a mismatch would hang); then rank 1's optimizer step raises and every rank raises it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plan_pass = _planned_pass(19)
    plan_pass.after_step()  # the compile step
    for _ in range(3 if rank == 0 else 1):
        assert plan_pass.after_step(boundary=False) is None
    plan_pass.after_step()  # boundary: measured step 1
    out = {"measured": plan_pass.calibration.measured}
    try:
        if rank == 1:
            plan_pass.after_step(boundary=True, error=ValueError("optimizer step failed on rank 1"))
        else:
            plan_pass.after_step()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["is_value_error"] = isinstance(exc, ValueError)
    return out


def test_accumulation_micro_steps_and_a_failing_step_keep_the_ranks_together():
    r0, r1 = run_ranks(_accumulation_and_failure_rank, 2, timeout=120, pg_timeout=20)
    for r in (r0, r1):
        assert r["measured"] == 1  # one optimizer step, not 2-4 micro-steps
        assert "optimizer step failed on rank 1" in r["error"] and r["is_value_error"], r


def _step_wrapper_rank():
    """The engine.step wrapper apply_memory_plan installs: it asks the engine whether the step ends
    an accumulation cycle (before stepping), measures only those, and shares a step's exception."""
    import torch.distributed as dist
    from fixtures.fx_profile import runtime_holding

    from hf_zero3.compile.memory_plan import _raise_plan_errors_from_forward

    rank = dist.get_rank()
    plan_pass = _planned_pass(23)

    class Engine:  # DeepSpeed's accumulation bookkeeping: gradient_accumulation_steps=2
        micro = 0

        def forward(self, x):
            return x

        def is_gradient_accumulation_boundary(self):
            return (self.micro + 1) % 2 == 0

        def step(self):
            self.micro += 1
            if rank == 1 and self.micro == 6:
                raise RuntimeError("CUDA out of memory (simulated) on rank 1")

    engine = Engine()
    _raise_plan_errors_from_forward(engine, runtime_holding(plan_pass))
    out = {}
    try:
        for _ in range(8):
            engine.forward(1)
            engine.step()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["is_runtime_error"] = isinstance(exc, RuntimeError)
    out["measured"] = plan_pass.calibration.measured  # boundaries 2 (compile step), 4; 6 failed
    out["micro"] = engine.micro
    return out


def test_the_step_wrapper_measures_optimizer_steps_and_shares_a_failing_one():
    r0, r1 = run_ranks(_step_wrapper_rank, 2, timeout=120, pg_timeout=20)
    for r in (r0, r1):
        assert r["micro"] == 6 and r["measured"] == 1, r
        assert "simulated) on rank 1" in r["error"] and r["is_runtime_error"], r
