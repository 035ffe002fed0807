"""One runtime per engine (issue #11): two ZeRO-3 engines in one process keep their own state and
agreements, and two data-parallel groups of two agree over their own group only (no WORLD
collective), for lockstep generation, eval regions and the memory-plan pass alike."""

from __future__ import annotations

import time

import torch

from hf_zero3.testing import CollectiveSpy, mark, run_ranks


def _two_engines():
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.errors import RankDivergenceError
    from hf_zero3.runtime import runtime_of

    rank = dist.get_rank()
    policy, policy_ref = build_engine(hf_aware=False, seed=0)
    reference, reference_ref = build_engine(hf_aware=False, seed=1)  # e.g. TRL's reference model
    hf_zero3.lockstep(policy, sync_every=2)
    hf_zero3.lockstep(reference, gather="layerwise")
    ids = torch.tensor([[5 + rank, 6, 7, 8]])
    gen = dict(input_ids=ids, max_new_tokens=5 + 3 * rank, pad_token_id=0, eos_token_id=None)
    out = {}
    mark("interleaved calls on two engines")
    with torch.no_grad():
        got = [policy.module.generate(**gen)]
        with hf_zero3.eval_forward(reference):
            ref_logits = reference.module(ids).logits
        got.append(reference.module.generate(**gen))
        with hf_zero3.eval_forward(policy, gather="layerwise"):
            pol_logits = policy.module(ids).logits
        exp = [policy_ref.generate(**gen, do_sample=False), reference_ref.generate(**gen, do_sample=False)]
        out["generate_ok"] = [g.tolist() == e.tolist() for g, e in zip(got, exp)]
        out["logits_ok"] = [
            torch.allclose(ref_logits, reference_ref(ids).logits, atol=1e-5),
            torch.allclose(pol_logits, policy_ref(ids).logits, atol=1e-5),
        ]
    rp, rr = runtime_of(policy), runtime_of(reference)
    out["distinct"] = rp is not rr and rp.engine is policy and rr.engine is reference
    out["keys"] = (rp.model_key(), rr.model_key())
    out["gathers"] = (rp.generation.last.gather, rr.generation.last.gather)
    out["lockstep"] = (rp.generation.config.sync_every, rr.generation.config.gather)
    mark("the two engines in a different order on each rank")
    first, second = (policy, reference) if rank == 0 else (reference, policy)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            first.module.generate(**gen)
            second.module.generate(**gen)
        out["swapped"] = None
    except RankDivergenceError as exc:
        out["swapped"], out["swapped_seconds"] = str(exc), time.perf_counter() - start
    return out


def test_two_engines_in_one_process_keep_their_own_runtime():
    res = run_ranks(_two_engines, 2, timeout=200, pg_timeout=20)
    for r in res:
        assert r["generate_ok"] == [True, True] and r["logits_ok"] == [True, True]
        assert r["distinct"] and r["keys"][0] != r["keys"][1]
        assert r["gathers"] == ("all", "layerwise") and r["lockstep"] == (2, "layerwise")
        # policy on one rank, reference on the other: named, instead of gathering the wrong model
        assert "They differ in:" in r["swapped"] and "model" in r["swapped"] and r["swapped_seconds"] < 5
    assert res[0]["keys"] == res[1]["keys"]


def _group_of_two():
    """Ranks {0,1} and {2,3} each hold a model partitioned over their own group and run lockstep
    generation, an eval region and the memory-plan pass; every collective must stay in the group."""
    import deepspeed
    import torch.distributed as dist
    from fixtures.fx_profile import STAND_IN_OPS, record_tiny_model
    from torch.fx import Interpreter

    import hf_zero3
    from hf_zero3.compile import MemoryPlanConfig, gate
    from hf_zero3.compile.gate import MemoryState
    from hf_zero3.compile.memory_plan import MemoryPlanPass
    from hf_zero3.runtime import runtime_of
    from hf_zero3.testing import models, strict_zero3_config
    from hf_zero3.zero3 import group_ranks

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    own = (2 * (rank // 2), 2 * (rank // 2) + 1)
    spy = CollectiveSpy().__enter__()
    model = models.plain_model(models.tiny_llama_config(), seed=rank // 2)
    deepspeed.zero.Init(module=model, data_parallel_group=mine, config_dict_or_path=strict_zero3_config())
    rt = runtime_of(model)
    out = {"group": group_ranks(rt.group)}
    mark("lockstep generate in my group")
    with torch.no_grad():
        gen = hf_zero3.lockstep_generate(
            model,
            input_ids=torch.tensor([[5 + rank, 7, 9]]),
            max_new_tokens=4 + rank % 2,
            eos_token_id=None,
            pad_token_id=0,
            gather="layerwise",
        )
        with hf_zero3.eval_forward(model):
            model(torch.tensor([[3, 4, 5]]))
    out["generated"] = gen.shape[1]
    mark("memory-plan pass agreeing over my group")
    rec = record_tiny_model()
    rec.bwd_graph, rec.bwd_mem, rec.bwd_time = rec.fwd_graph, rec.fwd_mem, rec.fwd_time
    rec.bwd_tensor_sizes, rec.fwd_mem_complete, rec.bwd_mem_complete = rec.fwd_tensor_sizes, True, True
    rec.process_group = None  # what DeepCompile's profile would leave: WORLD, unless the pass knows better
    peak = max(m[3] for m in rec.fwd_mem)
    state = MemoryState(allocated=peak // 2, reserved=peak // 2, free=10 * peak, total=11 * peak)
    plan_pass = MemoryPlanPass(
        MemoryPlanConfig(safety_margin=0.0),
        runtime=rt,
        ops=STAND_IN_OPS,
        read_memory=lambda: state,
        persist_fn=lambda ds_id: None,
    )
    gid = 21
    out_gm = plan_pass(rec.gm, gid, [(gid, True)], {gid: rec}, None, 0.0, None, True)
    gate.set_launch_group(gid, rt.group, state_fn=lambda: MemoryState(0, 0, 11 * peak, 11 * peak))
    gate.set_issue_fn(lambda graph_id, params, ids: dist.all_reduce(torch.ones(1), group=mine))
    with torch.no_grad():
        Interpreter(out_gm).run(*rec.inputs)
    gate.set_issue_fn(None)
    out["planned"] = plan_pass.error is None and plan_pass.summary()["prefetched"] > 0
    out["world_calls"] = spy.world_calls()
    out["own_calls"] = spy.total(own)
    out["other_calls"] = sum(n for (op, g), n in spy.calls.items() if g not in (own, "WORLD"))
    spy.__exit__()
    mark("final WORLD barrier")
    dist.barrier()
    return out


def test_two_data_parallel_groups_agree_over_their_own_group_only():
    res = run_ranks(_group_of_two, 4, timeout=240, pg_timeout=30)
    for rank, r in enumerate(res):
        assert r["group"] == (2 * (rank // 2), 2 * (rank // 2) + 1)
        assert r["planned"], r
        assert r["world_calls"] == 0 and r["other_calls"] == 0, r
        assert r["own_calls"] > 0
        assert r["generated"] == 3 + 4 + rank % 2  # each rank keeps its own max_new_tokens


def _hook_tables_around_suspension():
    import deepspeed

    from hf_zero3 import runtime
    from hf_zero3._upstream import deepspeed as ds_up
    from hf_zero3.testing import models, strict_zero3_config

    ds = strict_zero3_config(world_size=1)
    model = models.plain_model(models.tiny_llama_config())  # built plainly, handed to initialize
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    ids = ds_up.offload_hook_ids(ds_up.engine_offload(engine))
    mods = list(engine.module.modules())
    # a user hook beside DeepSpeed's on one module; DeepSpeed's only on the other
    mixed, alone = mods[3], mods[5]
    has_ds = all(any(k in ids for k in m._forward_pre_hooks) for m in (mixed, alone))
    user = mixed.register_forward_pre_hook(lambda m, a: None)
    before = [[list(t) for _, t in ds_up.module_hook_dicts(m)] for m in mods]
    with runtime.zero3_hooks_suspended(engine) as live:
        inside_ds = sum(k in ids for m in mods for _, t in ds_up.module_hook_dicts(m) for k in t)
        inside_user = user.id in mixed._forward_pre_hooks
        user.remove()  # removed meanwhile: stays removed
        added = alone.register_forward_pre_hook(lambda m, a: None)  # added meanwhile: stays, after
    after = [[list(t) for _, t in ds_up.module_hook_dicts(m)] for m in mods]
    expect = [[[k for k in t if k != user.id] for t in tables] for tables in before]
    expect[mods.index(alone)][0].append(added.id)
    return dict(
        has_ds=has_ds,
        live=live,
        inside_ds=inside_ds,
        inside_user=inside_user,
        ids=len(ids),
        same=after == expect,
        ds_first=after[mods.index(alone)][0][:-1] == before[mods.index(alone)][0],
    )


def test_deepspeed_hooks_come_off_and_back_in_their_order():
    """zero3_hooks_suspended on a real engine: inside, none of DeepSpeed's fetch/release hooks is on
    any module and a user hook stays; after, every table holds its hooks in the original order, a
    hook removed meanwhile stays removed and one added meanwhile comes after DeepSpeed's."""
    r = run_ranks(_hook_tables_around_suspension, 1, init="deepspeed", timeout=120, pg_timeout=30)[0]
    assert r["has_ds"] and r["live"] and r["ids"] > 0 and r["inside_ds"] == 0 and r["inside_user"]
    assert r["same"] and r["ds_first"]
