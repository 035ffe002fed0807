"""Compiled decoding in lockstep (``decode="compiled"``: static KV cache + transformers' compiled
decode step, inductor on CPU) under strict ZeRO-3 on 2 gloo ranks whose sequences end at different
steps: fp32 tokens identical to eager lockstep decoding and to an unsharded reference, the same
number of forwards on every rank, no recompile for another prompt length in the same bucket, and
an eager fallback that says why."""

import pytest
import torch

from hf_zero3.testing import mark, run_ranks


def _compiled_two_ranks():
    import os

    import torch.distributed as dist
    from _zero3_workers import ForwardCounter, build_engine

    import hf_zero3
    from hf_zero3.testing.scenarios import find_eos_scenario

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    sc = find_eos_scenario(ref)
    early_prompt, early_step = sc.early[0]
    counter = ForwardCounter(engine.module)
    gen = dict(max_new_tokens=sc.steps, eos_token_id=sc.eos_token_id, pad_token_id=0)
    results = {"steps": sc.steps, "eos_step_rank0": early_step}

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
    # a stop agreement every 3 steps: the static loop agrees at the same steps as transformers' loop
    run("eager_sync3", prompt, gather="all", decode="eager", sync_every=3)
    run("compiled_sync3", prompt, gather="all", decode="compiled", sync_every=3)
    run("compiled_fixed", prompt, gather="all", decode="compiled", stop="fixed")
    # stop agreements run ahead (HF_ZERO3_RUN_AHEAD=1): the step after each agreement is queued
    # before it and dropped at the agreed stop
    os.environ["HF_ZERO3_RUN_AHEAD"] = "1"
    try:
        run("compiled_ahead", prompt, gather="all", decode="compiled")
        run("compiled_sync3_ahead", prompt, gather="all", decode="compiled", sync_every=3)
        run("compiled_fixed_ahead", prompt, gather="all", decode="compiled", stop="fixed")
        # every rank's row ends early: the group stops before its budget (the dropped step)
        run("compiled_early_ahead", early_prompt, gather="all", decode="compiled", sync_every=2)
    finally:
        del os.environ["HF_ZERO3_RUN_AHEAD"]
    run("eager_early", early_prompt, gather="all", decode="eager", sync_every=2)
    run("eager_fixed", prompt, gather="all", decode="eager", stop="fixed")
    # a processor the static loop does not capture: transformers' compiled loop, and it says why
    run("compiled_rep", prompt, gather="all", decode="compiled", repetition_penalty=1.3)
    run("eager_rep", prompt, gather="all", decode="eager", repetition_penalty=1.3)
    # another prompt length in the same 64-token bucket: the compiled step is reused
    other = (sc.late[1] if rank == 0 else early_prompt)[: max(2, len(prompt) - 3)]
    run("eager_other", other, gather="all", decode="eager")
    run("compiled_other", other, gather="all", decode="compiled", bucket=64)
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
        for name in ("compiled", "compiled_other", "compiled_sync3", "compiled_fixed"):
            assert r[name]["loop"] == "hf_zero3" and r[name]["loop_reason"] is None, r[name]
            eager = r[name.replace("compiled", "eager")]
            # tokens, forwards, extra forwards and agreements as transformers' loop under lockstep
            for key in ("out", "forwards", "stat_forwards", "extra", "agreements"):
                assert r[name][key] == eager[key], (name, key, r[name][key], eager[key])
        assert r["compiled_fixed"]["stat_forwards"] == r["steps"]
        assert r["compiled_rep"]["loop"] == "transformers" and "RepetitionPenalty" in r["compiled_rep"]["loop_reason"]
        assert r["compiled_rep"]["decode"] == "compiled" and r["compiled_rep"]["out"] == r["eager_rep"]["out"]


def test_run_ahead_agreements_keep_the_tokens_agreements_and_counted_forwards(results):
    """With the step after each stop agreement queued before it: the same tokens, counted and extra
    forwards and agreements as transformers' loop; the model ran one forward more than counted
    where the group stopped before its budget (the dropped step), none in stop="fixed"."""
    for r in results:
        for name, eager in (
            ("compiled_ahead", "eager"),
            ("compiled_sync3_ahead", "eager_sync3"),
            ("compiled_fixed_ahead", "eager_fixed"),
            ("compiled_early_ahead", "eager_early"),
        ):
            assert r[name]["loop"] == "hf_zero3", r[name]
            for key in ("out", "stat_forwards", "extra", "agreements"):
                assert r[name][key] == r[eager][key], (name, key, r[name][key], r[eager][key])
            dropped = 1 if name != "compiled_fixed_ahead" and r[eager]["stat_forwards"] < r["steps"] else 0
            assert r[name]["forwards"] == r[eager]["forwards"] + dropped, (
                name,
                r[name]["forwards"],
                r[eager]["forwards"],
            )
    assert results[0]["eager_early"]["stat_forwards"] < results[0]["steps"]  # stopped early: a step dropped


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


def test_auto_is_the_default_and_declines_beside_deepcompile():
    """decode="auto" is lockstep's and Zero3Safe's default; it names why it does not compile beside
    DeepCompile's graphs (checked before the device, so it shows on CPU) and "compiled" overrides."""
    from transformers import LlamaForCausalLM

    import hf_zero3
    from hf_zero3.generation import compiled_decode
    from hf_zero3.generation.lockstep import LockstepConfig
    from hf_zero3.testing import models

    assert LockstepConfig().decode == "auto" and hf_zero3.Zero3Safe().lockstep.decode == "auto"
    model = LlamaForCausalLM(models.tiny_llama_config())
    kw = dict(max_new_tokens=4)
    want, why = compiled_decode.resolve(model, "auto", kw, deepcompile=True)
    assert not want and "DeepCompile" in why and "decode='compiled' forces it" in why
    assert compiled_decode.resolve(model, "compiled", kw, deepcompile=True) == (True, None)
    want, why = compiled_decode.resolve(model, "auto", kw, deepcompile=False)
    assert not want and "CUDA only" in why  # this machine's model is on CPU


def _grpo_compiled_rank(tmpdir: str, diverge_eos: bool):
    """TRL's GRPO (TRL gathers the model for its rollouts) with Zero3Safe(decode="compiled")."""
    import hf_zero3
    from hf_zero3.testing import trl_jobs

    trainer = trl_jobs.grpo_trainer(tmpdir, diverge_eos=diverge_eos, callbacks=[hf_zero3.Zero3Safe(decode="compiled")])
    trainer.train()
    last = hf_zero3.runtime_of(trainer.model).last_generate
    res = trl_jobs._result(trainer)
    return dict(
        decode=last.decode,
        reason=last.decode_reason,
        gather=last.gather,
        losses=res["losses"],
        forwards=res["forwards_per_call"],
        loop=last.loop,
        loop_reason=last.loop_reason,
    )


@pytest.mark.parametrize("diverge_eos", [False, True])
def test_trl_grpo_rollouts_take_the_compiled_path(tmp_path, diverge_eos):
    r0, r1 = run_ranks(
        _grpo_compiled_rank, 2, args=(str(tmp_path), diverge_eos), init="deepspeed", timeout=420, pg_timeout=60
    )
    for r in (r0, r1):
        assert r["gather"] == "held" and r["decode"] == "compiled", r
        if diverge_eos:  # the harness's rank-keyed EOS script is a Python logits processor: transformers' loop
            assert r["loop"] == "transformers" and "_Scripted" in r["loop_reason"], r
        else:  # TRL's default sampling settings are ones the static loop runs
            assert r["loop"] == "hf_zero3", r["loop_reason"]
        assert len(r["losses"]) == 2 and all(x == x for x in r["losses"])
    assert r0["forwards"] == r1["forwards"] and r0["losses"] == r1["losses"]


def _batch_sizes_rank():
    from _zero3_workers import build_engine

    import hf_zero3

    engine, _ = build_engine(hf_aware=False)
    out = []
    for b in (1, 2, 3, 4, 2):
        ids = torch.randint(3, engine.module.config.vocab_size, (b, 6), generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            hf_zero3.lockstep_generate(
                engine,
                input_ids=ids,
                max_new_tokens=8,
                pad_token_id=0,
                eos_token_id=None,
                gather="all",
                decode="compiled",
            )
        stats = engine.module.hf_zero3_last_generate
        out.append((b, stats.decode, stats.compiles))
    return out


def test_batch_sizes_recompile_once_then_reuse_a_dynamic_step():
    # Dynamo's automatic dynamic shapes: the second batch size compiles a batch-dynamic step once
    (r,) = run_ranks(_batch_sizes_rank, 1, init="deepspeed", timeout=300, pg_timeout=60)
    assert [d for _, d, _ in r] == ["compiled"] * 5
    assert [c > 0 for _, _, c in r] == [True, True, False, False, False], r


def _static_loop_batches_rank():
    """Left-padded batches with rows ending at different steps, seeded sampling, and a forward
    that stops compiling mid-call, through hf_zero3's static loop (2 ranks, fp32)."""
    import os

    import torch._dynamo
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.testing.scenarios import find_eos_scenario

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    sc = find_eos_scenario(ref)
    rows = [sc.early[0][0], sc.late[0], sc.late[1][:2]] if rank == 0 else [sc.late[2], sc.early[0][0][:3]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows])  # left padding, as TRL pads prompts
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    gen = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=sc.steps, eos_token_id=sc.eos_token_id, pad_token_id=0
    )
    out = {}

    def run(name, seed=None, **kw):
        mark(f"case {name}")
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            got = hf_zero3.lockstep_generate(engine, gather="all", sync_every=2, **{**gen, **kw})
        s = engine.module.hf_zero3_last_generate
        out[name] = dict(
            out=got.tolist(),
            loop=s.loop,
            loop_reason=s.loop_reason,
            decode=s.decode,
            reason=s.decode_reason,
            forwards=s.forwards,
            extra=s.extra_forwards,
            reused=s.loop_reused,
            attention=s.attention,
            fused=s.fused_projections,
            prefill=s.prefill,
            prefill_reason=s.prefill_reason,
            compiles=s.compiles,
            rope=s.rope_attention,
        )

    run("eager", decode="eager")
    run("compiled", decode="compiled")
    # the Triton attention kernel as on a GPU that it pays on (here Triton's interpreter): by
    # default the steps rotate, write the cache and attend in one kernel per layer, the fill counts
    # advanced after the forward; with HF_ZERO3_FUSE_ROPE=0 the model's rotary embedding and cache
    # update stay beside the kernel
    from hf_zero3.generation import decode_attention
    from hf_zero3.kernels import gqa_decode

    if os.environ.get("TRITON_INTERPRET") == "1" and gqa_decode.load() is not None:
        choice = decode_attention.choice
        decode_attention.choice = lambda model, device, rows: decode_attention.KERNEL
        try:
            os.environ.pop("HF_ZERO3_FUSE_ROPE", None)  # the default
            run("rope_kernel", decode="compiled")
            run("rope_kernel_again", decode="compiled")
            os.environ["HF_ZERO3_FUSE_ROPE"] = "0"
            try:
                run("kernel_unfused_rope", decode="compiled")
            finally:
                del os.environ["HF_ZERO3_FUSE_ROPE"]
        finally:
            decode_attention.choice = choice
    # the same prompts sliced from a wider tensor (row stride != length, as a prompt cut from a
    # longer batch): the compiled prompt forward does not compile again
    run("sliced", decode="compiled", input_ids=torch.cat([ids, ids[:, :3]], 1)[:, :-3])
    with torch.no_grad():
        out["reference"] = ref.generate(**gen).tolist()
    sampling = dict(do_sample=True, top_k=12, top_p=0.9, temperature=0.8)
    run("eager_sampled", seed=11 + rank, decode="eager", **sampling)
    run("compiled_sampled", seed=11 + rank, decode="compiled", **sampling)
    # a region held across calls (TRL's unwrap_model_for_generation): the same parameter storage,
    # so a second call reuses the first one's static buffers (on CUDA its graphs); a state the
    # compiled forward would guard on (training mode) does not
    with hf_zero3.eval_forward(engine, gather="all"):
        run("held_1", decode="compiled")
        run("held_2", decode="compiled")
        engine.module.train()
        try:
            run("held_train", decode="compiled")
        finally:
            engine.module.eval()
        run("held_sampled", seed=11 + rank, decode="compiled", **sampling)
        run("held_sampled_again", seed=11 + rank, decode="compiled", **sampling)

    # gradient checkpointing's input-require-grads hook (TRL's default, PEFT): Dynamo cannot trace
    # its requires_grad_(); under no_grad it changes nothing, so the decode steps run without it
    from hf_zero3._upstream.transformers import input_grad_hooks

    engine.module.enable_input_require_grads()
    try:
        run("input_grads", decode="compiled")
    finally:
        for handle in input_grad_hooks(engine.module):
            handle.remove()

    # a forward hook that stops compiling from its third call (a graph break under fullgraph=True;
    # nothing eagerly): the loop runs the rest of that call eagerly and says why; same tokens
    class PyCounter:
        n = 0

        def __call__(self, module, args):
            PyCounter.n += 1
            if PyCounter.n > 2:
                torch._dynamo.graph_break()

    handle = engine.module.register_forward_pre_hook(PyCounter())
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 2
    try:
        run("hooked", decode="compiled")
    finally:
        torch._dynamo.config.recompile_limit = limit
        handle.remove()
    out["hooked"]["calls"] = PyCounter.n
    run("hooked_after", decode="compiled")  # the failure is remembered: transformers' loop
    hf_zero3.release_decode_graphs(engine.module)  # the hook is gone: forget it, compile again
    run("released", decode="compiled")

    # a hook that breaks the graph for a prompt (more than one token) only: the prompt's forward
    # runs eagerly and says why, the decode steps stay compiled; the failure is remembered until
    # release; HF_ZERO3_COMPILE_PREFILL=0 keeps the prompt's forward eager without a reason
    def prompt_breaks(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            torch._dynamo.graph_break()

    handle = engine.module.register_forward_pre_hook(prompt_breaks, with_kwargs=True)
    try:
        run("prompt_hooked", decode="compiled")
        run("prompt_hooked_again", decode="compiled")
    finally:
        handle.remove()
    hf_zero3.release_decode_graphs(engine.module)
    run("prompt_released", decode="compiled")
    os.environ["HF_ZERO3_COMPILE_PREFILL"] = "0"
    try:
        run("prompt_eager", decode="compiled")
    finally:
        del os.environ["HF_ZERO3_COMPILE_PREFILL"]

    # after two training steps DeepSpeed's forward prologue (a hook on the module, so inside the
    # compiled __call__) starts its throughput timer with time.time(), which Dynamo cannot trace:
    # the decode steps run without the engine's prologue/epilogue hooks (TRL's third rollout)
    engine.train()
    for _ in range(2):
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.eval()
    run("trained_eager", decode="eager")
    run("trained", decode="compiled")
    run("trained_rep_eager", decode="eager", repetition_penalty=1.3)
    run("trained_rep", decode="compiled", repetition_penalty=1.3)  # transformers' compiled loop
    out["trained"]["engine_steps"] = engine.global_steps
    return out


@pytest.fixture(scope="module")
def batch_results():
    return run_ranks(_static_loop_batches_rank, 2, timeout=420, pg_timeout=60)


def test_static_loop_left_padded_batch_matches_eager_and_the_reference(batch_results):
    for r in batch_results:
        assert r["compiled"]["loop"] == "hf_zero3" and r["compiled"]["decode"] == "compiled", r["compiled"]
        assert r["compiled"]["prefill"] == "compiled" and r["eager"]["prefill"] is None, r["compiled"]
        assert r["sliced"]["out"] == r["compiled"]["out"] and r["sliced"]["compiles"] == 0, _fields(r["sliced"])
        assert r["compiled"]["out"] == r["eager"]["out"] == r["reference"]
        assert r["compiled"]["extra"] == r["eager"]["extra"]
    assert batch_results[0]["compiled"]["forwards"] == batch_results[1]["compiled"]["forwards"]


def test_static_loop_samples_the_tokens_eager_sampling_draws(batch_results):
    for r in batch_results:
        assert r["compiled_sampled"]["loop"] == "hf_zero3", r["compiled_sampled"]
        # same generator state, same processors, one multinomial draw per step: the same tokens
        assert r["compiled_sampled"]["out"] == r["eager_sampled"]["out"]
    assert any(r["compiled_sampled"]["out"] != r["compiled"]["out"] for r in batch_results)  # it did sample
    assert batch_results[0]["compiled_sampled"]["forwards"] == batch_results[1]["compiled_sampled"]["forwards"]


def test_the_rope_kernel_steps_give_eagers_tokens(batch_results):
    """Decode steps through the one-kernel rotary + cache write + attention (Triton's interpreter,
    compiled into the step as on a GPU) give eager decoding's tokens, compile nothing on a second
    call; with HF_ZERO3_FUSE_ROPE=0 the same kernel attends without the fusion."""
    from hf_zero3.generation.decode_attention import KERNEL

    if "rope_kernel" not in batch_results[0]:
        pytest.fail("the interpreted Triton kernel did not build (TRITON_INTERPRET=1 is set by conftest on CPU hosts)")
    for r in batch_results:
        for name in ("rope_kernel", "rope_kernel_again", "kernel_unfused_rope"):
            assert r[name]["out"] == r["eager"]["out"], name
            assert r[name]["loop"] == "hf_zero3" and r[name]["attention"] == KERNEL, r[name]
        assert r["rope_kernel"]["rope"] == r["rope_kernel_again"]["rope"] == 2  # both layers
        assert r["kernel_unfused_rope"]["rope"] == 0 and r["compiled"]["rope"] == 0
        assert r["rope_kernel_again"]["compiles"] == 0  # the compiled step and prefill of the first call
        assert r["rope_kernel"]["forwards"] == r["eager"]["forwards"]
    assert batch_results[0]["rope_kernel"]["forwards"] == batch_results[1]["rope_kernel"]["forwards"]


def test_a_second_call_reuses_the_loop_only_with_the_same_parameters_and_state(batch_results):
    from hf_zero3.generation.decode_attention import NAME

    for r in batch_results:
        for name in ("held_1", "held_2", "held_train"):
            assert r[name]["loop"] == "hf_zero3" and r[name]["out"] == r["eager"]["out"], (name, r[name])
        assert r["held_2"]["reused"] and not r["held_train"]["reused"]
        assert r["held_sampled_again"]["reused"] and r["held_sampled_again"]["out"] == r["eager_sampled"]["out"]
        assert r["held_sampled"]["out"] == r["eager_sampled"]["out"]
        # the tiny Llama is a GQA model: its decode steps attend with the grouped-heads attention
        assert r["compiled"]["attention"] == NAME and r["eager"]["attention"] is None
        # and their q/k/v projections run as one GEMM per layer (the tiny Llama has 2 layers)
        assert r["compiled"]["fused"] == r["held_2"]["fused"] == 2 and r["eager"]["fused"] == 0


def _fields(case: dict) -> str:
    """A case's stats in one line (an assertion message pytest does not shorten)."""
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "out")


def test_checkpointings_input_grad_hook_does_not_stop_the_compiled_step(batch_results):
    for r in batch_results:
        g = r["input_grads"]
        assert g["loop"] == "hf_zero3" and g["decode"] == "compiled", g
        assert g["out"] == r["eager"]["out"]


def test_the_compiled_step_survives_the_engines_training_steps(batch_results):
    for r in batch_results:
        t = r["trained"]
        assert t["engine_steps"] == 2
        assert t["loop"] == "hf_zero3" and t["decode"] == "compiled", _fields(t)
        assert t["out"] == r["trained_eager"]["out"] and t["forwards"] == r["trained_eager"]["forwards"]
        rep = r["trained_rep"]
        assert rep["loop"] == "transformers" and rep["decode"] == "compiled", rep
        assert rep["out"] == r["trained_rep_eager"]["out"]


def test_a_forward_that_stops_compiling_mid_call_finishes_eagerly(batch_results):
    for r in batch_results:
        h = r["hooked"]
        assert h["loop"] == "hf_zero3" and h["decode"] == "eager" and "does not compile" in h["reason"], _fields(h)
        assert h["out"] == r["eager"]["out"]
        assert h["calls"] == h["forwards"]  # the hook ran in every forward, compiled or eager
        assert r["hooked_after"]["loop"] == "transformers" and "does not compile" in r["hooked_after"]["loop_reason"]
        assert r["released"]["loop"] == "hf_zero3" and r["released"]["decode"] == "compiled", r["released"]["reason"]
        assert r["hooked_after"]["out"] == r["released"]["out"] == r["eager"]["out"]


def test_a_prompt_forward_that_does_not_compile_runs_eagerly_and_the_steps_stay_compiled(batch_results):
    for r in batch_results:
        h, again = r["prompt_hooked"], r["prompt_hooked_again"]
        for case in (h, again):
            assert case["loop"] == "hf_zero3" and case["decode"] == "compiled", _fields(case)
            assert case["prefill"] == "eager" and "does not compile" in case["prefill_reason"], _fields(case)
            assert case["out"] == r["eager"]["out"]
        assert r["prompt_released"]["prefill"] == "compiled" and r["prompt_released"]["prefill_reason"] is None
        assert r["prompt_eager"]["prefill"] == "eager" and r["prompt_eager"]["prefill_reason"] is None
        assert r["prompt_released"]["out"] == r["prompt_eager"]["out"] == r["eager"]["out"]
