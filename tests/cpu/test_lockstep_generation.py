"""Lockstep generation under strict ZeRO-3 on real gloo ranks (issue: lockstep generation).

Each test launches the ranks once and runs several scenarios there (rank start-up dominates on
CPU); every scenario compares tokens with ``generate()`` on an unsharded copy of the same weights
and counts decode forwards per rank.
"""

import pytest
import torch

from hf_zero3.testing import CollectiveSpy, mark, run_ranks


def _scenarios_two_ranks():
    import torch.distributed as dist
    from _zero3_workers import ForwardCounter, build_engine
    from fixtures.scenarios import find_eos_scenario

    import hf_zero3

    spy = CollectiveSpy().__enter__()  # before DeepSpeed caches its collective functions
    rank = dist.get_rank()
    # engine-only: transformers cannot see ZeRO-3, the case that deadlocks with raw generate()
    engine, ref = build_engine(hf_aware=False)
    sc = find_eos_scenario(ref)
    early_prompt, early_step = sc.early[0]
    prompt = early_prompt if rank == 0 else sc.late[0]
    counter = ForwardCounter(engine.module)
    results = {"eos_step_rank0": early_step, "steps": sc.steps, "n_params": len(list(engine.module.parameters()))}
    gen = dict(max_new_tokens=sc.steps, eos_token_id=sc.eos_token_id, pad_token_id=0)

    def run(name, ids, attn=None, **kw):
        mark(f"scenario {name}")
        lk = {k: kw.pop(k) for k in ("stop", "sync_every", "gather") if k in kw}
        extra = {} if attn is None else {"attention_mask": attn}
        before = spy.total()
        snap = dict(spy.calls)
        if kw.get("do_sample"):
            torch.manual_seed(1234)
        with torch.no_grad():
            out = hf_zero3.lockstep_generate(engine, input_ids=ids, **extra, **gen, **lk, **kw)
        stats = engine.module.hf_zero3_last_generate
        forwards = counter.take()
        collectives = spy.total() - before
        ops = {k: v - snap.get(k, 0) for k, v in spy.calls.items() if v - snap.get(k, 0)}
        if kw.get("do_sample"):
            torch.manual_seed(1234)
        with torch.no_grad():
            exp = ref.generate(input_ids=ids, **extra, **gen, **kw)
        results[name] = dict(
            match=out.tolist() == exp.tolist(),
            out=out.tolist(),
            exp=exp.tolist(),
            forwards=forwards,
            stats=stats,
            collectives=collectives,
            ops=ops,
            ref_len=exp.shape[1] - ids.shape[1],
        )

    ids = torch.tensor([prompt])
    run("sync1_all", ids, stop="sync", sync_every=1, gather="all")
    run("sync4_layerwise", ids, stop="sync", sync_every=4, gather="layerwise")
    run("fixed_layerwise", ids, stop="fixed", gather="layerwise")
    run("sync16_auto", ids, stop="sync", sync_every=16, gather="auto")
    run("sample_sync", ids, stop="sync", sync_every=2, do_sample=True, top_k=20)
    run("beam_sync", ids, stop="sync", num_beams=2)
    # rank 1: a batch with one early and one late row, left padded (shorter prompt)
    if rank == 1:
        a, b = early_prompt, sc.late[1][1:]
        batch = torch.tensor([a, [0] + b])
        attn = torch.tensor([[1] * len(a), [0] + [1] * len(b)])
    else:
        batch = torch.tensor([sc.late[2], sc.late[3]])
        attn = torch.ones_like(batch)
    run("batch_mixed_leftpad", batch, attn, stop="sync", sync_every=1)
    mark("done")
    spy.__exit__()
    return results


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_scenarios_two_ranks, 2, timeout=240, pg_timeout=20)


SCENARIOS = [
    "sync1_all",
    "sync4_layerwise",
    "fixed_layerwise",
    "sync16_auto",
    "sample_sync",
    "beam_sync",
    "batch_mixed_leftpad",
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_tokens_match_unsharded_reference(two_rank_results, name):
    for rank, res in enumerate(two_rank_results):
        r = res[name]
        assert r["match"], f"rank {rank} {name}: got {r['out']} expected {r['exp']}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_rank_runs_the_same_number_of_forwards(two_rank_results, name):
    f0, f1 = (res[name]["forwards"] for res in two_rank_results)
    assert f0 == f1 > 0
    assert two_rank_results[0][name]["stats"].forwards == f0


def test_divergent_eos_really_diverges(two_rank_results):
    r0, r1 = two_rank_results
    # rank 0's own output stops at its EOS, rank 1 runs the full budget
    assert r0["sync1_all"]["ref_len"] == r0["eos_step_rank0"] < r0["steps"]
    assert r1["sync1_all"]["ref_len"] == r1["steps"]


@pytest.mark.parametrize("name,sync_every", [("sync1_all", 1), ("sync4_layerwise", 4), ("sync16_auto", 16)])
def test_sync_stops_within_sync_every_of_last_eos(two_rank_results, name, sync_every):
    last_needed = max(res[name]["ref_len"] for res in two_rank_results)
    forwards = two_rank_results[0][name]["forwards"]
    assert last_needed <= forwards < last_needed + sync_every


def test_sync_every_cuts_agreements(two_rank_results):
    assert (
        two_rank_results[0]["sync1_all"]["stats"].agreements
        > two_rank_results[0]["sync4_layerwise"]["stats"].agreements
    )


def test_fixed_runs_exactly_max_new_tokens(two_rank_results):
    for res in two_rank_results:
        assert res["fixed_layerwise"]["forwards"] == res["steps"]
        # the call's opening agreement and its end; none per step
        assert res["fixed_layerwise"]["stats"].agreements == 2


def test_gather_once_has_no_per_token_collectives(two_rank_results):
    for res in two_rank_results:
        all_, lw = res["sync1_all"], res["sync4_layerwise"]
        assert all_["stats"].gather == "all" and lw["stats"].gather == "layerwise"
        ag = {op: n for (op, g), n in all_["ops"].items()}
        # gather-all: the model is gathered once (DeepSpeed issues one all-gather per parameter
        # inside its coalesced gather), then only the call's agreements run (the first one also
        # decides the gathering)
        assert ag["all_gather_into_tensor"] == res["n_params"]
        assert ag["all_reduce"] == all_["stats"].agreements
        # layer-wise: every forward gathers every parameter again
        lw_gathers = sum(n for (op, g), n in lw["ops"].items() if op == "all_gather_into_tensor")
        assert lw_gathers >= lw["forwards"] * res["n_params"]


def _subgroup_generates():
    """Ranks 0 and 1 hold a model partitioned over their own group; rank 2 stays out of every
    collective until the end. A WORLD collective during generate would hang (rank 2 never joins)."""
    import os
    import time

    import deepspeed
    import torch.distributed as dist

    import hf_zero3
    from hf_zero3.testing import models, strict_zero3_config

    rank = dist.get_rank()
    sub = dist.new_group([0, 1])
    flag = os.environ["FLAG_DIR"]
    result = None
    if rank in (0, 1):
        spy = CollectiveSpy().__enter__()
        model = models.plain_model(models.tiny_llama_config())
        deepspeed.zero.Init(
            module=model, data_parallel_group=sub, config_dict_or_path=strict_zero3_config()
        )  # partition over {0, 1}
        lens = []
        for gather in ("all", "layerwise"):
            mark(f"subgroup generate gather={gather}")
            ids = torch.tensor([[5 + rank, 7, 9]])
            with torch.no_grad():
                out = hf_zero3.lockstep_generate(
                    model, input_ids=ids, max_new_tokens=6 + 4 * rank, eos_token_id=None, pad_token_id=0, gather=gather
                )
            lens.append(out.shape[1])
        result = dict(
            lens=lens, world=spy.world_calls(), sub=spy.total((0, 1)), gathered=model.hf_zero3_last_generate.gather
        )
        spy.__exit__()
        open(os.path.join(flag, f"done{rank}"), "w").close()
    else:
        mark("rank 2 waiting outside every collective")
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(flag, f"done{r}")) for r in (0, 1)):
            assert time.monotonic() < deadline, "ranks 0/1 never finished"
            time.sleep(0.05)
    mark("final WORLD barrier")
    dist.barrier()
    return result


def test_subgroup_generation_uses_no_world_collective(tmp_path):
    res = run_ranks(_subgroup_generates, 3, timeout=150, pg_timeout=15, env={"FLAG_DIR": str(tmp_path)})
    for rank in (0, 1):
        r = res[rank]
        assert r["world"] == 0
        assert r["sub"] > 0
        # max_new_tokens differ per rank (6 vs 10); each rank keeps its own output length
        assert r["lens"] == [3 + 6 + 4 * rank] * 2


def _bad_inputs():
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.errors import RankDivergenceError

    rank = dist.get_rank()
    engine, _ = build_engine()
    errors = {}

    def expect(name, fn):
        mark(f"bad input {name}")
        try:
            with torch.no_grad():
                fn()
            errors[name] = None
        except (ValueError, RankDivergenceError) as e:
            errors[name] = str(e)

    ids = torch.tensor([[3, 4, 5, 6][: 2 + 2 * rank]])  # unequal prompt lengths
    expect(
        "fixed_max_length",
        lambda: hf_zero3.lockstep_generate(engine, input_ids=ids, max_length=10, stop="fixed", pad_token_id=0),
    )
    expect(
        "gather_differs",
        lambda: hf_zero3.lockstep_generate(
            engine, input_ids=ids, max_new_tokens=3, pad_token_id=0, gather="all" if rank == 0 else "layerwise"
        ),
    )
    expect(
        "fixed_max_time",
        lambda: hf_zero3.lockstep_generate(
            engine, input_ids=ids, max_new_tokens=3, max_time=5.0, stop="fixed", pad_token_id=0
        ),
    )
    expect("bad_stop", lambda: hf_zero3.lockstep_generate(engine, input_ids=ids, stop="eventually"))
    groups = [dist.new_group([0]), dist.new_group([1])]
    expect(
        "group_mismatch",
        lambda: hf_zero3.lockstep_generate(engine, input_ids=ids, max_new_tokens=3, pad_token_id=0, group=groups[rank]),
    )
    # sync mode with max_length and unequal prompts is fine: the longer budget wins, documented
    with torch.no_grad():
        out = hf_zero3.lockstep_generate(engine, input_ids=ids, max_length=10, eos_token_id=None, pad_token_id=0)
    errors["sync_max_length_len"] = out.shape[1]
    errors["sync_max_length_forwards"] = engine.module.hf_zero3_last_generate.forwards
    return errors


def test_bad_input_gets_clear_errors():
    res = run_ranks(_bad_inputs, 2, timeout=150, pg_timeout=15)
    for rank, errs in enumerate(res):
        assert "stop='fixed' needs the same number of steps" in errs["fixed_max_length"]
        assert "They differ in: gather" in errs["gather_differs"]
        assert "max_time cannot shorten stop='fixed'" in errs["fixed_max_time"]
        assert "stop must be one of" in errs["bad_stop"]
        assert "every rank that gathers must take part" in errs["group_mismatch"]
        assert errs["sync_max_length_len"] == 10
        # budgets 8 (rank 0) and 6 (rank 1): both run the agreed maximum
        assert errs["sync_max_length_forwards"] == 8


def _three_ranks_models():
    import torch.distributed as dist
    from _zero3_workers import ForwardCounter, build_engine

    import hf_zero3

    rank = dist.get_rank()
    out = {}
    for cfg_name in ("tiny_qwen2_config", "tiny_t5_config"):
        mark(f"{cfg_name}")
        engine, ref = build_engine(cfg_name)
        counter = ForwardCounter(engine.module)
        ids = torch.tensor([[4 + rank, 9, 11, 13, 2 if cfg_name == "tiny_t5_config" else 17]])
        # each rank its own EOS so that all three finish at different steps
        eos = _eos_at(ref, ids, step=2 + 3 * rank, steps=12)
        kw = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=0, do_sample=False)
        with torch.no_grad():
            got = hf_zero3.lockstep_generate(engine, input_ids=ids, sync_every=2, **kw)
            forwards = counter.take()
            exp = ref.generate(input_ids=ids, **kw)
        out[cfg_name] = dict(
            match=got.tolist() == exp.tolist(),
            forwards=forwards,
            ref_len=exp.shape[1],
            got=got.tolist(),
            exp=exp.tolist(),
        )
        # compiled decoding asked for: an encoder-decoder model decodes eagerly and says why
        with torch.no_grad():
            again = hf_zero3.lockstep_generate(
                engine, input_ids=ids, sync_every=2, gather="all", decode="compiled", **kw
            )
        st = engine.module.hf_zero3_last_generate
        out[cfg_name]["compiled"] = dict(
            match=again.tolist() == exp.tolist(), decode=st.decode, reason=st.decode_reason, forwards=counter.take()
        )
    return out


def _eos_at(ref, ids, step, steps):
    with torch.no_grad():
        seq = ref.generate(
            input_ids=ids,
            max_new_tokens=steps,
            min_new_tokens=steps,
            eos_token_id=None,
            pad_token_id=0,
            do_sample=False,
        )
    new = seq[0, -steps:].tolist()
    for k in range(step - 1, steps):
        if new[k] not in new[:k]:
            return new[k]
    return 95  # a token it never produced: runs the full budget


def test_three_ranks_qwen2_and_t5_encoder_decoder():
    res = run_ranks(_three_ranks_models, 3, timeout=200, pg_timeout=20)
    for name in ("tiny_qwen2_config", "tiny_t5_config"):
        forwards = {r[name]["forwards"] for r in res}
        assert len(forwards) == 1, f"{name}: forwards differ per rank {forwards}"
        for rank, r in enumerate(res):
            assert r[name]["match"], f"{name} rank {rank}: {r[name]['got']} vs {r[name]['exp']}"
            assert r[name]["compiled"]["match"], (name, rank, r[name]["compiled"])
        assert len({r[name]["compiled"]["forwards"] for r in res}) == 1
    for r in res:
        # Qwen2 compiles (decode="compiled" forces it on CPU); T5 cannot and says so
        assert r["tiny_qwen2_config"]["compiled"]["decode"] == "compiled", r["tiny_qwen2_config"]["compiled"]
        t5 = r["tiny_t5_config"]["compiled"]
        assert t5["decode"] == "eager" and t5["reason"] == "encoder-decoder model", t5


def _peft_lora(decode: str = "eager"):
    import deepspeed
    import torch.distributed as dist
    from _zero3_workers import ForwardCounter
    from peft import LoraConfig, get_peft_model

    import hf_zero3
    from hf_zero3.testing import models, strict_zero3_config

    rank = dist.get_rank()
    models.ensure_deepspeed_comm()
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(models.plain_model(models.tiny_llama_config()), lora)
    torch.manual_seed(7)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:  # non-zero B so the adapter changes the outputs
            torch.nn.init.normal_(p, std=0.5)
    ref = get_peft_model(models.plain_model(models.tiny_llama_config()), lora)
    ref.load_state_dict(peft_model.state_dict())
    ref.eval()
    ds = strict_zero3_config(world_size=2)
    engine, *_ = deepspeed.initialize(
        model=peft_model, config=ds, model_parameters=[p for p in peft_model.parameters() if p.requires_grad]
    )
    engine.eval()
    hf_zero3.lockstep(engine, sync_every=2, decode=decode)
    counter = ForwardCounter(engine.module.get_base_model())
    ids = torch.tensor([[5 + rank, 8, 13]])
    eos = 95 if rank == 1 else None
    kw = dict(max_new_tokens=6 + 6 * rank, do_sample=False, pad_token_id=0, eos_token_id=eos)
    with torch.no_grad():
        got = engine.module.generate(input_ids=ids, **kw)
        forwards = counter.take()
        exp = ref.generate(input_ids=ids, **kw)
    stats = engine.module.get_base_model().hf_zero3_last_generate
    return dict(
        match=got.tolist() == exp.tolist(),
        got=got.tolist(),
        exp=exp.tolist(),
        forwards=forwards,
        gather=stats.gather,
        loop=stats.loop,
        decode=stats.decode,
        zero3=hf_zero3.zero3.is_zero3_model(engine.module),
    )


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_peft_lora_model_generates_in_lockstep(decode):
    res = run_ranks(_peft_lora, 2, args=(decode,), timeout=240, pg_timeout=30)
    # "compiled": hf_zero3's static loop through the LoRA layers (fp32, tokens identical)
    assert all(r["loop"] == ("hf_zero3" if decode == "compiled" else "transformers") for r in res), res
    assert all(r["decode"] == decode for r in res), res
    assert all(r["zero3"] for r in res)
    assert res[0]["forwards"] == res[1]["forwards"] == 12  # budgets 6 and 12: agreed max
    for rank, r in enumerate(res):
        assert r["match"], f"rank {rank}: {r['got']} vs {r['exp']}"
        assert r["gather"] == "all"
