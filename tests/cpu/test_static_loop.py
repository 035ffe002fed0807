"""hf_zero3's static decode loop (``decode="compiled"``) on left-padded batches under strict ZeRO-3 on
2 gloo ranks (fp32, inductor on CPU): tokens equal eager lockstep decoding and an unsharded
reference, seeded sampling draws eager's tokens, the rope kernel's steps, a loop reused only with
the same parameters and state, checkpointing's input-grad hook, the engine's training steps, and a
forward or prompt forward that stops compiling. Apart from test_compiled_decode.py so that the two
modules' compiled runs can go to different test workers."""

import pytest

from hf_zero3.testing import mark, run_ranks


def _static_loop_batches_rank():
    """Left-padded batches with rows ending at different steps, seeded sampling, and a forward
    that stops compiling mid-call, through hf_zero3's static loop (2 ranks, fp32)."""
    import os

    import torch._dynamo
    import torch.distributed as dist
    from _zero3_workers import build_engine
    from fixtures.scenarios import find_eos_scenario

    import hf_zero3

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    sc = find_eos_scenario(ref)
    # three rows on each rank: one batch size, so the ranks compile the same graphs (one compiles
    # them, the other reads inductor's cache: hf_zero3.testing.run_ranks)
    rows = [sc.early[0][0], sc.late[0], sc.late[1][:2]] if rank == 0 else [sc.late[2], sc.early[0][0][:3], sc.late[1]]
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
            attention=s.decode_report.attention,
            fused=s.decode_report.fused_projections,
            prefill=s.prefill,
            prefill_reason=s.prefill_reason,
            compiles=s.compiles,
            rope=s.decode_report.rope_attention,
            step=s.step,
            layers=s.decode_report.compiled_layers,
        )

    run("eager", decode="eager")
    run("compiled", decode="compiled")
    # the decode steps as the model's own forward (a TRL rollout's defaults): nothing compiled
    eager_step = hf_zero3.DecodeOptions(compile_step=False, compile_prefill=False)
    run("eager_step", decode="compiled", decode_options=eager_step)
    # one compiled decoder layer that every layer runs (DecodeOptions.compile_layers)
    layered = hf_zero3.DecodeOptions(compile_prefill=False, compile_layers=True)
    run("layer_step", decode="compiled", decode_options=layered)
    run("layer_step_again", decode="compiled", decode_options=layered)
    # the prompt's forward the same way (compile_prefill on): a layer graph of its own
    layered_prompt = hf_zero3.DecodeOptions(compile_layers=True)
    run("layer_prefill", decode="compiled", decode_options=layered_prompt)
    run("layer_prefill_again", decode="compiled", decode_options=layered_prompt)
    # the same call under torch's profiler: the loop's phases are ranges in its trace
    # (hf_zero3.decode.phases), with the same tokens and graphs as without one
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run("profiled", decode="compiled")
    out["profiled"]["phases"] = sorted({e.name for e in prof.events() if e.name.startswith("hf_zero3.")})
    # the Triton attention kernel as on a GPU that it pays on (here Triton's interpreter): by
    # default the steps rotate, write the cache and attend in one kernel per layer, the fill counts
    # advanced after the forward; with HF_ZERO3_FUSE_ROPE=0 the model's rotary embedding and cache
    # update stay beside the kernel
    from hf_zero3.decode import gqa_attention
    from hf_zero3.kernels import gqa_decode

    if os.environ.get("TRITON_INTERPRET") == "1" and gqa_decode.load() is not None:
        choice = gqa_attention.choice
        gqa_attention.choice = lambda model, device, rows, kernel="auto", eager=False: gqa_attention.KERNEL
        try:
            os.environ.pop("HF_ZERO3_FUSE_ROPE", None)  # the default
            run("rope_kernel", decode="compiled")
            run("rope_kernel_again", decode="compiled")
            run("kernel_unfused_rope", decode="compiled", decode_options=hf_zero3.DecodeOptions(fuse_rope=False))
            run("rope_kernel_eager_step", decode="compiled", decode_options=eager_step)
            run("rope_kernel_layer_step", decode="compiled", decode_options=layered)
        finally:
            gqa_attention.choice = choice
    # the same prompts sliced from a wider tensor (row stride != length, as a prompt cut from a
    # longer batch): the compiled prompt forward does not compile again
    run("sliced", decode="compiled", input_ids=torch.cat([ids, ids[:, :3]], 1)[:, :-3])
    with torch.no_grad():
        out["reference"] = ref.generate(**gen).tolist()
    sampling = dict(do_sample=True, top_k=12, top_p=0.9, temperature=0.8)
    run("eager_sampled", seed=11 + rank, decode="eager", **sampling)
    run("compiled_sampled", seed=11 + rank, decode="compiled", **sampling)
    run("eager_step_sampled", seed=11 + rank, decode="compiled", decode_options=eager_step, **sampling)
    run("layer_step_sampled", seed=11 + rank, decode="compiled", decode_options=layered, **sampling)
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

    # a hook on one layer's MLP that Dynamo cannot trace: that layer's graph does not compile, so
    # it runs its own forward, the rest of the step too, and the next step compiles whole (which
    # the hook stops as well: the call finishes eagerly); the same tokens
    def breaks(module, args):
        torch._dynamo.graph_break()

    handle = engine.module.model.layers[1].mlp.register_forward_pre_hook(breaks)
    try:
        run("layer_hooked", decode="compiled", decode_options=layered)
    finally:
        handle.remove()
    hf_zero3.release_decode_graphs(engine.module)
    # traceable hooks that differ between the layers (the graphs guard on hooks): each layer would
    # compile a graph of its own, so after the second in one step the step compiles whole
    layers = engine.module.model.layers
    handles = [
        layers[0].mlp.register_forward_pre_hook(lambda m, a: None),
        layers[1].mlp.register_forward_hook(lambda m, a, o: None),
    ]
    try:
        run("layer_hooks_differ", decode="compiled", decode_options=layered)
    finally:
        for h in handles:
            h.remove()
    hf_zero3.release_decode_graphs(engine.module)

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
    # processors that read the sequence so far, computed on the loop's buffers: transformers' tokens
    procs = dict(repetition_penalty=1.3, min_new_tokens=3)
    run("trained_rep_eager", decode="eager", **procs)
    run("trained_rep", decode="compiled", **procs)
    # temperature, top-k, top-p and min-p together, three sequences of one prompt (TRL's
    # num_generations; three rows, the batch size the loop already compiled for)
    many = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, min_p=0.05, num_return_sequences=3)
    many.update(input_ids=ids[:1], attention_mask=mask[:1], **procs)
    run("trained_many_eager", seed=9 + rank, decode="eager", **many)
    run("trained_many", seed=9 + rank, decode="compiled", **many)
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


def test_the_models_own_forward_runs_the_steps_with_compile_step_off(batch_results):
    """``DecodeOptions(compile_step=False, compile_prefill=False)``: the static loop with nothing
    compiled (not the greedy tail either), the tokens of eager decoding and of the reference, and
    seeded sampling's draws."""
    for r in batch_results:
        e = r["eager_step"]
        assert e["loop"] == "hf_zero3" and e["decode"] == "compiled" and e["step"] == "eager", _fields(e)
        assert e["prefill"] == "eager" and e["compiles"] == 0 and e["reason"] is None, _fields(e)
        assert e["out"] == r["eager"]["out"] == r["reference"], _fields(e)
        assert e["forwards"] == r["compiled"]["forwards"] and r["compiled"]["step"] == "compiled"
        assert r["eager_step_sampled"]["out"] == r["eager_sampled"]["out"], _fields(r["eager_step_sampled"])
        assert r["eager_step_sampled"]["step"] == "eager" and r["eager_step_sampled"]["compiles"] == 0
        k = r["rope_kernel_eager_step"]  # Triton's interpreter: the rope kernel launched eagerly
        assert k["out"] == r["eager"]["out"] and k["rope"] == r["rope_kernel"]["rope"] > 0, _fields(k)
        assert k["step"] == "eager" and k["compiles"] == 0, _fields(k)


def test_a_profiled_call_shows_the_loops_phases_and_decodes_alike(batch_results):
    """Under a profiler the loop labels its phases (here no CUDA graphs: steps one by one) and
    decodes as without one: the same tokens, nothing compiled again."""
    from hf_zero3.decode.phases import PHASES

    every_call = {"decode", "prefill", "loop_lookup", "start", "first_token", "bind", "snapshot", "agree", "step"}
    for r in batch_results:
        p = r["profiled"]
        assert p["loop"] == "hf_zero3" and p["out"] == r["compiled"]["out"] and p["compiles"] == 0, p
        seen = {name.removeprefix("hf_zero3.") for name in p["phases"]}
        assert every_call | {"result"} <= seen <= set(PHASES), seen


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
    from hf_zero3.decode.gqa_attention import KERNEL

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
    from hf_zero3.decode.gqa_attention import NAME

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
        rep = r["trained_rep"]  # repetition_penalty, min_new_tokens
        assert rep["loop"] == "hf_zero3" and rep["decode"] == "compiled", _fields(rep)
        assert rep["out"] == r["trained_rep_eager"]["out"]
        assert r["trained_rep"]["out"] != r["trained"]["out"]  # the processors changed the tokens
        many = r["trained_many"]
        assert many["loop"] == "hf_zero3" and many["out"] == r["trained_many_eager"]["out"], _fields(many)
        assert len(many["out"]) == 3 and len({tuple(o) for o in many["out"]}) > 1  # three different samples


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


def test_one_compiled_layer_runs_every_layer_with_compile_layers(batch_results):
    """``DecodeOptions(compile_layers=True)``: the model's forward runs the steps (and, with the
    prompt forward compiled, the prompt's) and each decoder layer runs one compiled layer: one
    graph for both layers (the greedy tail was compiled by an earlier call), one more for the
    prompt's layers, none on a second call or with sampling, the tokens of eager decoding, of the
    reference and of seeded sampling, the rope kernel inside it (Triton's interpreter); a layer
    that does not compile runs its own forward, and layers that would each compile a graph make
    the step compile whole: the call still gives eager decoding's tokens."""
    for r in batch_results:
        e = r["layer_step"]
        assert e["loop"] == "hf_zero3" and e["decode"] == "compiled" and e["step"] == "layers", _fields(e)
        assert e["layers"] == 2 and e["compiles"] == 1 and e["prefill"] == "eager", _fields(e)
        assert e["out"] == r["eager"]["out"] == r["reference"], _fields(e)
        again = r["layer_step_again"]
        assert again["out"] == e["out"] and again["compiles"] == 0, _fields(again)
        sampled = r["layer_step_sampled"]
        assert sampled["out"] == r["eager_sampled"]["out"] and sampled["step"] == "layers", _fields(sampled)
        assert sampled["compiles"] == 0, _fields(sampled)
        k = r["rope_kernel_layer_step"]
        assert k["out"] == r["eager"]["out"] and k["rope"] == 2 and k["step"] == "layers", _fields(k)
        assert k["layers"] == 2 and k["compiles"] == 1, _fields(k)
        h = r["layer_hooked"]
        assert h["out"] == r["eager"]["out"] and h["layers"] == 0 and h["step"] != "layers", _fields(h)
        p, p2 = r["layer_prefill"], r["layer_prefill_again"]
        assert p["prefill"] == "layers" and p["step"] == "layers" and p["prefill_reason"] is None, _fields(p)
        assert p["out"] == r["eager"]["out"] and p["compiles"] == 1, _fields(p)  # the prompt's layer graph
        assert p2["out"] == p["out"] and p2["compiles"] == 0 and p2["prefill"] == "layers", _fields(p2)
        d = r["layer_hooks_differ"]
        assert d["out"] == r["eager"]["out"] and d["layers"] == 0 and d["step"] == "compiled", _fields(d)


def _sliding_window_rank():
    """Models with sliding-window attention through the static loop, the step eager and compiled
    (2 ranks, fp32): a Mistral built from its default config (a 4096-token window), a Qwen2 whose
    second layer slides (a hybrid cache: one full layer, one sliding), and each with a window
    shorter than the call."""
    import torch
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3

    rank = dist.get_rank()
    hybrid = dict(use_sliding_window=True, max_window_layers=1)
    models = {
        "mistral": ("tiny_mistral_config", {}),
        "mistral_short": ("tiny_mistral_config", {"sliding_window": 8}),
        "hybrid": ("tiny_qwen2_config", {**hybrid, "sliding_window": 16}),
        "hybrid_short": ("tiny_qwen2_config", {**hybrid, "sliding_window": 8}),
    }
    out = {}
    for name, (config, overrides) in models.items():
        engine, ref = build_engine(config, hf_aware=False, **overrides)
        torch.manual_seed(rank)
        ids = torch.randint(3, 90, (3, 7))
        mask = torch.ones_like(ids)
        ids[0, : 2 + rank], mask[0, : 2 + rank] = 0, 0  # left padding, a different length on each rank
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)  # 13 tokens
        with torch.no_grad():
            reference = ref.generate(**gen, do_sample=False).tolist()
        for step in ("eager", "compiled"):
            mark(f"case {name} step={step}")
            opts = hf_zero3.DecodeOptions(compile_prefill=False, compile_step=step == "compiled")
            with torch.no_grad():
                got = hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", decode_options=opts, **gen)
            s = engine.module.hf_zero3_last_generate
            out[f"{name}_{step}"] = dict(
                out=got.tolist(),
                reference=reference,
                loop=s.loop,
                loop_reason=s.loop_reason,
                step=s.step,
                compiles=s.compiles,
                rings=s.decode_report.ring_layers,
            )
    return out


def test_a_sliding_window_takes_the_static_loop_whether_the_call_fills_it_or_not():
    """Mistral's default config builds sliding-window cache layers, and a Qwen2 with a sliding window
    on some layers a hybrid cache; a call that cannot fill the window never slides, so the loop runs
    it on static layers of one length (the compiled step: one graph, where a host-side fill count
    would have compiled one per step); a window shorter than the call slides as a ring
    (:mod:`hf_zero3.decode.ring_cache`), one graph too. Both with the reference's tokens."""
    for r in run_ranks(_sliding_window_rank, 2, timeout=300, pg_timeout=60):
        for name in ("mistral", "hybrid"):
            for step in ("eager", "compiled"):
                for case, rings in ((name, 0), (f"{name}_short", 1)):
                    c = r[f"{case}_{step}"]
                    assert c["loop"] == "hf_zero3" and c["loop_reason"] is None and c["step"] == step, (case, c)
                    assert c["out"] == c["reference"], (case, c)
                    assert (c["rings"] > 0) == bool(rings), (case, c)
        assert r["mistral_compiled"]["compiles"] == 2, r["mistral_compiled"]  # the step and the greedy tail
        # the ring's step: one graph for every token (the greedy tail compiled already)
        assert r["mistral_short_compiled"]["compiles"] == 1, r["mistral_short_compiled"]
