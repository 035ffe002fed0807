"""Compiled decoding in lockstep (``decode="compiled"``: static KV cache + transformers' compiled
decode step, inductor on CPU) under strict ZeRO-3 on 2 gloo ranks whose sequences end at different
steps: fp32 tokens identical to eager lockstep decoding and to an unsharded reference, the same
number of forwards on every rank, no recompile for another prompt length in the same bucket, and
an eager fallback that says why."""

import pytest
import torch

from hf_zero3.testing import mark, run_ranks


def _compiled_two_ranks():

    import torch.distributed as dist
    from _zero3_workers import ForwardCounter, build_engine
    from fixtures.scenarios import find_eos_scenario

    import hf_zero3

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    sc = find_eos_scenario(ref)
    early_prompt, early_step = sc.early[0]
    counter = ForwardCounter(engine.module)
    gen = dict(max_new_tokens=sc.steps, eos_token_id=sc.eos_token_id, pad_token_id=0)
    results = {"steps": sc.steps, "eos_step_rank0": early_step, "rank": rank}

    def run(name, prompt, **kw):
        mark(f"scenario {name}")
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_zero3.lockstep_generate(engine, input_ids=ids, **{**gen, **kw})
        stats = engine.module.hf_zero3_last_generate
        with torch.no_grad():
            exp = ref.generate(input_ids=ids, **gen)
        results[name] = dict(
            out=out.tolist(),
            exp=exp.tolist(),
            forwards=counter.take(),
            decode=stats.decode,
            reason=stats.decode_reason,
            compiles=stats.compiles,
            gather=stats.gather,
            stat_forwards=stats.forwards,
            loop=stats.loop,
            loop_reason=stats.loop_reason,
            extra=stats.extra_forwards,
            agreements=stats.agreements,
            prefill=stats.prefill,
        )

    prompt = early_prompt if rank == 0 else sc.late[0]
    run("eager", prompt, gather="all", decode="eager")
    run("compiled", prompt, gather="all", decode="compiled", bucket=64)
    # a stop agreement every 3 steps (compiled: on the previous check's flags)
    run("eager_sync3", prompt, gather="all", decode="eager", sync_every=3)
    run("compiled_sync3", prompt, gather="all", decode="compiled", sync_every=3)
    run("compiled_fixed", prompt, gather="all", decode="compiled", stop="fixed")
    # every rank's row ends early: the group stops before its budget
    run("compiled_early", early_prompt, gather="all", decode="compiled", sync_every=2)
    run("eager_early", early_prompt, gather="all", decode="eager", sync_every=2)
    run("eager_fixed", prompt, gather="all", decode="eager", stop="fixed")
    # the default stop checks with compiled decoding: every COMPILED_SYNC_EVERY steps on the previous
    # check's flags, alike in the static loop and in transformers' (a no-op n-gram ban keeps it there)
    run("compiled_late", early_prompt, gather="all", decode="compiled")
    run("transformers_late", early_prompt, gather="all", decode="compiled", no_repeat_ngram_size=10_000)
    # a processor the static loop computes on its buffers (repetition_penalty), and one it does not
    # take (no_repeat_ngram_size): transformers' compiled loop, and it says why
    run("compiled_rep", prompt, gather="all", decode="compiled", repetition_penalty=1.3)
    run("eager_rep", prompt, gather="all", decode="eager", repetition_penalty=1.3)
    run("compiled_ngram", prompt, gather="all", decode="compiled", no_repeat_ngram_size=2)
    run("eager_ngram", prompt, gather="all", decode="eager", no_repeat_ngram_size=2)
    # another prompt length in the same 64-token bucket: the compiled step is reused
    other = (sc.late[1] if rank == 0 else early_prompt)[: max(2, len(prompt) - 3)]
    run("eager_other", other, gather="all", decode="eager")
    run("compiled_other", other, gather="all", decode="compiled", bucket=64)
    # TF32 matmuls turned on between two calls (a trainer did so between rollouts): no recompile
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    try:
        run("compiled_tf32", other, gather="all", decode="compiled", bucket=64)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    run("layerwise", prompt, gather="layerwise", decode="compiled")
    run("beams", prompt, gather="all", decode="compiled", num_beams=2)
    run("auto_cpu", prompt, gather="all", decode="auto")
    # max_length only: ranks' prompts differ, the group runs the largest budget: no static cache
    run(
        "max_length_only",
        prompt,
        gather="all",
        decode="compiled",
        max_new_tokens=None,
        max_length=len(prompt) + sc.steps,
    )
    # one rank compiles, the other decodes eagerly: the first agreement gives both the late schedule
    run("mixed", early_prompt, gather="all", decode="compiled" if rank == 0 else "eager")
    results["mixed"]["late"] = engine.module.hf_zero3_last_generate.late_checks
    mark("done")
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_compiled_two_ranks, 2, timeout=420, pg_timeout=60)


def test_compiled_tokens_equal_eager_and_the_reference_in_fp32(results):
    for r in results:
        for name in ("compiled", "compiled_other"):
            assert r[name]["decode"] == "compiled" and r[name]["reason"] is None, r[name]
            assert r[name]["prefill"] == "compiled", r[name]  # the prompt's forward compiled too
            assert r[name]["out"] == r[name.replace("compiled", "eager")]["out"] == r[name]["exp"], name


def test_static_loop_runs_and_matches_transformers_loop_in_every_stop_mode(results):
    for r in results:
        for name in ("compiled", "compiled_other", "compiled_sync3", "compiled_fixed", "compiled_early"):
            assert r[name]["loop"] == "hf_zero3" and r[name]["loop_reason"] is None, r[name]
            eager = r[name.replace("compiled", "eager")]
            # tokens as transformers' eager loop under lockstep, and with no stop check (stop="fixed")
            # its forwards and agreements too (compiled decoding checks late: see the late-check test)
            same_checks = name == "compiled_fixed"
            keys = ("out", "forwards", "stat_forwards", "extra", "agreements") if same_checks else ("out",)
            for key in keys:
                assert r[name][key] == eager[key], (name, key, r[name][key], eager[key])
        assert r["compiled_fixed"]["stat_forwards"] == r["steps"]
        assert r["compiled_early"]["stat_forwards"] < r["steps"]  # every row done: the group stopped early
        assert r["compiled_rep"]["loop"] == "hf_zero3" and r["compiled_rep"]["out"] == r["eager_rep"]["out"]
        ngram = r["compiled_ngram"]
        assert ngram["loop"] == "transformers" and "NoRepeatNGram" in ngram["loop_reason"], ngram
        assert ngram["decode"] == "compiled" and ngram["out"] == r["eager_ngram"]["out"]


def test_compiled_stop_checks_are_late_and_alike_in_both_loops(results):
    """Compiled decoding's stop checks agree on the previous check's flags (by default every
    COMPILED_SYNC_EVERY steps): the group stops one window after the check that saw every row done,
    the static loop and transformers' compiled loop check at the same steps, the tokens are eager
    decoding's; a rank that decodes eagerly beside a compiled one checks on the same schedule."""
    from hf_zero3.generation.config import COMPILED_SYNC_EVERY

    for r in results:
        late, hf = r["compiled_late"], r["transformers_late"]
        assert late["loop"] == "hf_zero3" and hf["loop"] == "transformers", (late, hf)
        done = r["eager_early"]["stat_forwards"] - r["eager_early"]["extra"]  # the group's last EOS (every rank's)
        for name, every in (("compiled_late", COMPILED_SYNC_EVERY), ("compiled_early", 2)):
            expected = min(r["steps"], -(-done // every) * every + every)
            assert r[name]["stat_forwards"] == expected, (name, r[name]["stat_forwards"], done, every)
            assert r[name]["out"] == r["eager_early"]["out"], name
        for key in ("out", "forwards", "stat_forwards", "extra", "agreements"):
            assert late[key] == hf[key], (key, late[key], hf[key])
        mixed = r["mixed"]
        assert mixed["late"] and mixed["stat_forwards"] == late["stat_forwards"], mixed
        assert mixed["out"] == r["eager_early"]["out"] and mixed["decode"] == ("compiled", "eager")[r["rank"]]


def test_divergent_eos_and_equal_forwards_on_every_rank(results):
    r0, r1 = results
    assert r0["eos_step_rank0"] < r0["steps"]  # rank 0's row ends early; rank 1's runs on
    for name in ("compiled", "compiled_other", "eager", "compiled_sync3", "compiled_fixed"):
        assert r0[name]["forwards"] == r1[name]["forwards"] > 1, name
        assert r0[name]["stat_forwards"] == r1[name]["stat_forwards"], name


def test_first_call_compiles_and_a_second_length_in_the_bucket_does_not(results):
    for r in results:
        assert r["compiled"]["compiles"] > 0
        assert r["compiled_other"]["compiles"] == 0, r["compiled_other"]
        # the static loop runs with the TF32 setting of its first call (Dynamo guards on it)
        assert r["compiled_tf32"]["compiles"] == 0 and r["compiled_tf32"]["out"] == r["compiled_other"]["out"]


def test_unsupported_cases_decode_eagerly_and_say_why(results):
    for r in results:
        assert r["layerwise"]["decode"] == "eager" and "layerwise" in r["layerwise"]["reason"]
        assert r["layerwise"]["out"] == r["layerwise"]["exp"]
        assert r["beams"]["decode"] == "eager" and "beam search" in r["beams"]["reason"]
        assert r["auto_cpu"]["decode"] == "eager" and "CUDA only" in r["auto_cpu"]["reason"]
        assert r["auto_cpu"]["out"] == r["auto_cpu"]["exp"]
        assert r["max_length_only"]["decode"] == "eager" and "max_new_tokens" in r["max_length_only"]["reason"]


def test_bad_decode_settings_are_refused_by_name():
    from hf_zero3.generation.lockstep import LockstepConfig

    with pytest.raises(ValueError, match="decode must be one of"):
        LockstepConfig(decode="fast").validate()
    with pytest.raises(ValueError, match="bucket must be a positive int"):
        LockstepConfig(bucket=0).validate()
    with pytest.raises(ValueError, match="graph_steps must be an int >= 0"):
        LockstepConfig(graph_steps=-1).validate()


def test_auto_is_the_default_and_takes_trl_rollouts_despite_disable_compile():
    """decode="auto" is lockstep's and Zero3Safe's default. A generation config's disable_compile
    keeps it eager, except in a TRL trainer's rollouts (TRL sets it; there it keeps only
    transformers' compiled loop off); "compiled" overrides it everywhere. Checked before the
    device, so it shows on CPU, where "auto" then declines for the device."""
    from transformers import LlamaForCausalLM

    import hf_zero3
    from hf_zero3.decode.plan import DecodeRequest, plan
    from hf_zero3.generation.lockstep import LockstepConfig
    from hf_zero3.testing import models

    assert LockstepConfig().decode == "auto" and hf_zero3.Zero3Safe().lockstep.decode == "auto"
    model = LlamaForCausalLM(models.tiny_llama_config())
    kw = dict(max_new_tokens=4, disable_compile=True)

    def step(mode, kwargs, trl=None):
        return plan(model, DecodeRequest.of(model, mode, kwargs, trl=trl))

    decided = step("auto", kw)
    assert not decided.compiled and "disable_compile" in decided.step_reason
    assert "decode='compiled' overrides it" in decided.step_reason
    decided = step("auto", kw, trl="GRPOTrainer")
    assert not decided.compiled and "CUDA only" in decided.step_reason  # this machine's model is on CPU
    auto, compiled = DecodeRequest.of(model, "auto", kw), DecodeRequest.of(model, "compiled", kw)
    assert auto.own_loop_only and not compiled.own_loop_only
    assert step("compiled", kw).compiled and step("compiled", kw).step_reason is None
    decided = step("auto", dict(max_new_tokens=4))
    assert not decided.compiled and "CUDA only" in decided.step_reason
