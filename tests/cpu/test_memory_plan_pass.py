"""The DeepCompile pass itself (``MemoryPlanPass``), called as DeepCompile calls it, on the recorded
FX graph of a real Llama over two gloo ranks whose memory differs: agreed profile and budget,
identical plans, the rewritten graph's gated prefetches and the persistent set identical on both
ranks, the result unchanged; and an impossible budget surfacing as a named error from the next
forward instead of a Dynamo graph break."""

from __future__ import annotations

import torch

from hf_zero3.testing import run_ranks


def _pass_rank(limit_slack: int):
    import torch.distributed as dist
    from fixtures.fx_profile import STAND_IN_OPS, collective_issue, record_tiny_backward
    from torch.fx import Interpreter

    from hf_zero3.compile import MemoryPlanConfig, gate
    from hf_zero3.compile.gate import MemoryState
    from hf_zero3.compile.memory_plan import MemoryPlanPass

    rank, gid = dist.get_rank(), 11
    rec = record_tiny_backward()
    with torch.no_grad():
        reference = Interpreter(rec.gm).run(*rec.inputs)
    peak = max(m[3] for m in rec.fwd_mem)
    total = peak + limit_slack if limit_slack >= 0 else peak // 4  # below what stays resident
    # rank 1 holds 4 KB more cached-but-free memory: its budget is the tighter one
    frag = 1000 + 4000 * rank
    state = MemoryState(allocated=peak // 2, reserved=peak // 2 + frag, free=total - peak // 2 - frag, total=total)
    persisted = []
    # calibrate_steps=0: the profile is trusted, persistence chosen at compile (calibration has its own tests)
    plan_pass = MemoryPlanPass(
        MemoryPlanConfig(safety_margin=0.0, calibrate_steps=0),
        ops=STAND_IN_OPS,
        read_memory=lambda: state,
        persist_fn=persisted.append,
    )
    out_gm = plan_pass(rec.gm, gid, [(gid, True)], {gid: rec}, None, 0.0, None, True)
    result = dict(
        rank=rank,
        error=repr(plan_pass.error) if plan_pass.error else None,
        persisted=persisted,
        summary=plan_pass.summary(),
        rewritten=out_gm is not None,
    )
    if out_gm is None:

        class Engine:  # the seam apply_memory_plan installs on a DeepSpeed engine
            def forward(self, x):
                return x

        from fixtures.fx_profile import runtime_holding

        from hf_zero3.compile.memory_plan import _raise_plan_errors_from_forward

        engine = Engine()
        _raise_plan_errors_from_forward(engine, runtime_holding(plan_pass))
        try:
            engine.forward(1)
        except Exception as exc:  # noqa: BLE001
            result["forward_error"] = f"{type(exc).__name__}: {exc}"
        return result
    rec_state = MemoryState(allocated=0, reserved=0, free=total, total=total)
    gate.set_launch_group(gid, None, state_fn=lambda: rec_state)
    issued = []
    gate.set_issue_fn(collective_issue(issued))
    with torch.no_grad():
        out = Interpreter(out_gm).run(*rec.inputs)
    gate.set_issue_fn(None)
    result.update(
        issued=issued, same_output=torch.equal(out, reference), budget=plan_pass.records[(gid, True)].budget.budget
    )
    return result


def test_pass_plans_rewrites_and_persists_identically_across_ranks():
    r0, r1 = run_ranks(_pass_rank, 2, args=(60_000,), timeout=240, pg_timeout=60)
    for r in (r0, r1):
        assert r["error"] is None and r["rewritten"], r
        assert r["same_output"]
    assert r0["summary"] == r1["summary"] and r0["summary"]["prefetched"] > 0
    assert r0["budget"] == r1["budget"]  # the tighter rank's (rank 1's fragmentation) for both
    assert r0["issued"] == r1["issued"] and len(r0["issued"]) == r0["summary"]["slots"]
    assert r0["persisted"] == r1["persisted"]
    assert 0 < len(r0["persisted"]) < r0["summary"]["gathers"]  # the budget's leftover, not everything


def test_impossible_budget_is_raised_by_the_next_forward_with_its_fix():
    for r in run_ranks(_pass_rank, 2, args=(-1,), timeout=240, pg_timeout=60):
        assert not r["rewritten"] and "BudgetTooSmallError" in r["error"]
        assert "at every node" in r["forward_error"] and "Raise the limit" in r["forward_error"]


def _one_rank_fails_while_planning():
    """Rank 1 cannot read its memory while planning; rank 0 plans normally up to that point."""
    import torch.distributed as dist
    from fixtures.fx_profile import STAND_IN_OPS, record_tiny_backward

    from hf_zero3.compile import MemoryPlanConfig
    from hf_zero3.compile.gate import MemoryState
    from hf_zero3.compile.memory_plan import MemoryPlanPass

    rank, gid = dist.get_rank(), 13
    rec = record_tiny_backward()
    nodes_before = len(rec.gm.graph.nodes)
    peak = max(m[3] for m in rec.fwd_mem)

    def read_memory():
        if rank == 1:
            raise RuntimeError("cudaMemGetInfo failed on rank 1")
        return MemoryState(allocated=peak // 2, reserved=peak // 2, free=10 * peak, total=11 * peak)

    plan_pass = MemoryPlanPass(
        MemoryPlanConfig(safety_margin=0.0), ops=STAND_IN_OPS, read_memory=read_memory, persist_fn=lambda ds_id: None
    )
    out = plan_pass(rec.gm, gid, [(gid, True)], {gid: rec}, None, 0.0, None, True)
    return dict(
        out=out is None,
        error=repr(plan_pass.error),
        untouched=len(rec.gm.graph.nodes) == nodes_before,
        graphs=plan_pass.summary()["graphs"],
    )


def test_a_planning_failure_on_one_rank_leaves_the_graph_unplanned_on_every_rank():
    for r in run_ranks(_one_rank_fails_while_planning, 2, timeout=120, pg_timeout=20):
        assert r["out"] and r["untouched"] and r["graphs"] == 0
        assert "RankRuntimeError" in r["error"] and "cudaMemGetInfo failed on rank 1" in r["error"], r["error"]
