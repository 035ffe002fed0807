"""The real TRL trainers and DeepSpeed's ``HybridEngineRollout`` under strict ZeRO-3 on 2 gloo ranks.

Every TRL case trains a tiny trainer of :mod:`fixtures.trl_jobs` for 2 optimizer steps
with ``callbacks=[Zero3Safe()]`` (which applies :func:`hf_zero3.trl.apply`), the ranks made to
diverge on purpose (per-rank EOS, a tool call on rank 0 only, per-rank GKD draws), and checks
that both ranks finish with the same losses (a mean over the group) and ran the same
``generate()`` calls with the same decode forwards. Controls run the worst cases without the fix
and must crash or hang. Each launch runs several trainers one after another (rank start-up
dominates on CPU).
"""

import math

import pytest
import torch

from hf_zero3.testing import DistributedFailure, mark, run_ranks

GRPO_LEN, TOOL_LEN, GKD_LEN, GOLD_LEN, DISTILL_LEN = 16, 80, 8, 8, 16  # trl_jobs' budgets
STEPS = 2  # trl_jobs' max_steps


# -- rank functions ------------------------------------------------------------------------------
def _train(build, tmpdir, **kwargs):
    """Build a trl_jobs trainer with Zero3Safe, train it; its results plus the runtime report."""
    from fixtures import trl_jobs

    import hf_zero3

    mark(f"building {build.__name__} {kwargs}")
    hooks = trl_jobs.EmbeddingHookCount()
    trainer = build(tmpdir, callbacks=[hf_zero3.Zero3Safe(), hooks], **kwargs)
    mark(f"training {build.__name__} {kwargs}")
    trainer.train()
    out = trl_jobs._result(trainer)
    out["embedding_hooks"] = hooks.counts
    last = hf_zero3.runtime_of(trainer.model).generation.last
    out["gather"] = last.gather if last is not None else None
    out["trainer_model"] = type(trainer.model).__name__
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    out["only_lora_trains"] = bool(trainable) and all("lora_" in n for n in trainable)
    out["first_draw"] = next(
        (cb.first_draw for cb in trainer.callback_handler.callbacks if isinstance(cb, trl_jobs.DivergentDraws)), None
    )
    return out


GRPO_CASES = {
    "grpo_gather": dict(gather=True),
    "grpo_nogather": dict(gather=False),
    "grpo_eos": dict(gather=True, diverge_eos=True),
    "grpo_tools_gather": dict(gather=True, tools=True),
    "grpo_tools_nogather": dict(gather=False, tools=True),
    "grpo_peft_lora": dict(gather=True, peft=True),
    "grpo_eval_gather": dict(gather=True, evaluate=True),
    "grpo_eval_nogather": dict(gather=False, evaluate=True),
}
DISTILL_CASES = {
    "gkd_draws": ("gkd_trainer", dict(lmbda=0.5)),  # trl_jobs default: divergent draws
    "gold_eos": ("gold_trainer", dict(diverge_eos=True)),
    "distill_eos": ("distillation_trainer", dict(diverge_eos=True)),
    "distill_tools": ("distillation_trainer", dict(tools=True)),
    "distill_eval": ("distillation_trainer", dict(evaluate=True)),
    "rloo_eos_eval": ("rloo_trainer", dict(diverge_eos=True, evaluate=True)),
}


def _grpo_cases(tmpdir):
    from fixtures import trl_jobs

    return {name: _train(trl_jobs.grpo_trainer, f"{tmpdir}/{name}", **kw) for name, kw in GRPO_CASES.items()}


def _distill_cases(tmpdir):
    from fixtures import trl_jobs

    return {
        name: _train(getattr(trl_jobs, build), f"{tmpdir}/{name}", **kw) for name, (build, kw) in DISTILL_CASES.items()
    }


# -- fixtures: one launch per trainer family -----------------------------------------------------
@pytest.fixture(scope="module")
def grpo_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    return run_ranks(_grpo_cases, 2, args=(str(tmp),), init="deepspeed", timeout=320, pg_timeout=20)


@pytest.fixture(scope="module")
def distill_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    return run_ranks(_distill_cases, 2, args=(str(tmp),), init="deepspeed", timeout=300, pg_timeout=20)


def _both(results, name):
    return results[0][name], results[1][name]


def _check_common(r0, r1, budget):
    """Both ranks: same finite losses (one per step), same calls, same forwards per call."""
    assert len(r0["losses"]) == STEPS and all(math.isfinite(x) for x in r0["losses"])
    assert r0["losses"] == r1["losses"]  # logged as the group's mean: bit-identical
    assert r0["generate_calls"] == r1["generate_calls"] > 0
    assert r0["decode_forwards"] == r1["decode_forwards"]
    assert r0["forwards_per_call"] == r1["forwards_per_call"]
    assert sum(r0["forwards_per_call"]) == r0["decode_forwards"]
    assert all(1 <= f <= budget for f in r0["forwards_per_call"]), r0["forwards_per_call"]
    # TRL's checkpointing disable/enable around each rollout leaves no hook behind (a compile guard)
    assert len(r0["embedding_hooks"]) == STEPS and len(set(r0["embedding_hooks"])) == 1, r0["embedding_hooks"]


def _log(result, key):
    return [h[key] for h in result["logs"] if key in h]


# -- GRPO ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,gather", [("grpo_gather", "held"), ("grpo_nogather", "all")])
def test_grpo_default_reuses_trl_gather(grpo_results, name, gather):
    r0, r1 = _both(grpo_results, name)
    _check_common(r0, r1, GRPO_LEN)
    assert r0["generate_calls"] == STEPS  # one generation round per step
    # ds3_gather_for_generation=True: TRL's GatheredParameters model is used as it is (no second
    # gather); False: lockstep gathers the whole model once per call itself
    assert r0["gather"] == r1["gather"] == gather


def test_grpo_divergent_eos_runs_the_longest_ranks_steps(grpo_results):
    r0, r1 = _both(grpo_results, "grpo_eos")
    _check_common(r0, r1, GRPO_LEN)
    # rank 0's rows end at their 2nd token, rank 1's never: both ranks run rank 1's full budget
    assert r0["forwards_per_call"] == [GRPO_LEN] * STEPS
    assert _log(r0, "completions/min_length") == [2.0] * STEPS
    assert _log(r0, "completions/max_length") == [float(GRPO_LEN)] * STEPS
    assert r0["gather"] == "held"


@pytest.mark.parametrize("name", ["grpo_tools_gather", "grpo_tools_nogather"])
def test_grpo_tool_round_of_one_rank_is_joined(grpo_results, name):
    r0, r1 = _both(grpo_results, name)
    _check_common(r0, r1, TOOL_LEN)
    # per step: the first turn and rank 0's post-tool turn, which rank 1 joins with a placeholder
    assert r0["generate_calls"] == r1["generate_calls"] == 2 * STEPS
    first, post = r0["forwards_per_call"][0::2], r0["forwards_per_call"][1::2]
    # post-tool turn: rank 0 ends at its first token, the placeholder counts as finished, so the
    # agreed stop comes after one forward
    assert post == [1] * STEPS
    # first turn: rank 0's tool call ends early, rank 1 never calls a tool and runs its budget
    assert first == [TOOL_LEN] * STEPS
    assert _log(r0, "tools/call_frequency") and all(x > 0 for x in _log(r0, "tools/call_frequency"))
    assert r0["gather"] == r1["gather"] == ("held" if name == "grpo_tools_gather" else "all")


@pytest.mark.parametrize("name", ["grpo_eval_gather", "grpo_eval_nogather"])
def test_grpo_evaluates_between_steps(grpo_results, name):
    """GRPO generates for each eval batch, between eval forwards that hold Zero3Safe's eval region:
    TRL's gather for generation must not meet the region's (DeepSpeed refuses nested gathers)."""
    r0, r1 = _both(grpo_results, name)
    _check_common(r0, r1, GRPO_LEN)
    assert _log(r0, "eval_loss") == _log(r1, "eval_loss") and len(_log(r0, "eval_loss")) == STEPS
    assert all(math.isfinite(x) for x in _log(r0, "eval_loss"))
    # per step: one rollout and one generation per eval batch (2 a rank)
    assert r0["generate_calls"] == r1["generate_calls"] == STEPS * (1 + 2)


def test_grpo_peft_lora(grpo_results):
    r0, r1 = _both(grpo_results, "grpo_peft_lora")
    assert r0["trainer_model"] == "PeftModel" and r0["only_lora_trains"]
    _check_common(r0, r1, GRPO_LEN)
    assert r0["generate_calls"] == STEPS
    assert r0["gather"] == r1["gather"] == "held"


# -- GKD / GOLD / DistillationTrainer ------------------------------------------------------------
def test_gkd_divergent_draws_take_one_branch(distill_results):
    r0, r1 = _both(distill_results, "gkd_draws")
    # the scripted step-0 draws really differ: rank 0 on-policy, rank 1 off-policy
    assert r0["first_draw"] <= 0.5 < r1["first_draw"]
    _check_common(r0, r1, GKD_LEN)
    # rank 0's draw decides for the group: step 0 generates on both ranks
    assert 1 <= r0["generate_calls"] <= STEPS


def test_gold_divergent_eos(distill_results):
    r0, r1 = _both(distill_results, "gold_eos")
    _check_common(r0, r1, GOLD_LEN)
    assert r0["forwards_per_call"] == [GOLD_LEN] * STEPS  # lmbda=1.0: every step generates


def test_distillation_divergent_eos(distill_results):
    r0, r1 = _both(distill_results, "distill_eos")
    _check_common(r0, r1, DISTILL_LEN)
    assert r0["forwards_per_call"] == [DISTILL_LEN] * STEPS


def test_distillation_evaluates_between_steps(distill_results):
    """DistillationTrainer generates for each eval batch too (same eval-region release as GRPO)."""
    r0, r1 = _both(distill_results, "distill_eval")
    _check_common(r0, r1, DISTILL_LEN)
    assert _log(r0, "eval_loss") == _log(r1, "eval_loss") and len(_log(r0, "eval_loss")) == STEPS
    assert r0["generate_calls"] == STEPS * (1 + 2)


def test_rloo_divergent_eos_and_evaluation(distill_results):
    r0, r1 = _both(distill_results, "rloo_eos_eval")
    _check_common(r0, r1, GRPO_LEN)
    assert r0["forwards_per_call"] == [GRPO_LEN] * (STEPS * 3)  # rank 1's rows run the budget
    assert _log(r0, "eval_loss") == _log(r1, "eval_loss") and len(_log(r0, "eval_loss")) == STEPS


def test_distillation_tool_round_of_one_rank_is_joined(distill_results):
    r0, r1 = _both(distill_results, "distill_tools")
    _check_common(r0, r1, TOOL_LEN)
    assert r0["generate_calls"] == 2 * STEPS
    assert r0["forwards_per_call"][1::2] == [1] * STEPS


# -- controls: the same divergence without the fix crashes or hangs ------------------------------
# (No control for GRPO with TRL's defaults: its old failure no longer reproduces without the fix.)
def _control(run_name, tmpdir, **kwargs):
    from fixtures import trl_jobs

    return getattr(trl_jobs, run_name)(tmpdir, **kwargs)  # no Zero3Safe


def _expect_failure(tmp_path, run_name, **kwargs):
    with pytest.raises(DistributedFailure) as info:
        run_ranks(
            _control, 2, args=(run_name, str(tmp_path)), kwargs=kwargs, init="deepspeed", timeout=60, pg_timeout=8
        )
    failure = info.value
    assert "ok" not in failure.outcomes.values(), failure.outcomes
    # it broke while training, not while building
    assert all(r.state.startswith("training") for r in failure.reports), str(failure)
    return failure


def test_control_grpo_tools_without_fix_crashes(tmp_path):
    failure = _expect_failure(tmp_path, "run_grpo", tools=True)
    # rank 1 left TRL's tool loop one generate() early: gloo aborts or errors on a mismatch
    assert set(failure.outcomes.values()) <= {"error", "died"}, str(failure)


def test_control_gkd_divergent_draws_without_fix_hangs(tmp_path):
    failure = _expect_failure(tmp_path, "run_gkd")
    # rank 0 generates (gathering per layer), rank 1 does not: a collective waits in vain
    assert failure.timed_out, str(failure)


def _grpo_eval_without_region_release(tmpdir):
    """GRPO evaluating between steps with Zero3Safe, its wrapper of TRL's gather for generation
    removed (the failure first seen on GPU under DeepCompile)."""
    from fixtures import trl_jobs

    import hf_zero3
    from hf_zero3._upstream import patches

    trainer = trl_jobs.grpo_trainer(tmpdir, evaluate=True, callbacks=[hf_zero3.Zero3Safe()])
    assert patches.remove("trl.models.utils._unwrap_model_for_generation: release the eval region first")
    mark("training")
    trainer.train()


def _grpo_hooks_without_shim(tmpdir):
    """GRPO (TRL's default checkpointing) with Zero3Safe, the input-grad hook shim removed: the
    input embeddings' forward hooks after each step."""
    from fixtures import trl_jobs

    import hf_zero3

    hooks = trl_jobs.EmbeddingHookCount()
    trainer = trl_jobs.grpo_trainer(tmpdir, callbacks=[hf_zero3.Zero3Safe(), hooks])
    from hf_zero3._upstream import patches

    assert patches.remove("transformers.PreTrainedModel.enable_input_require_grads: replace, not add")
    trainer.train()
    return hooks.counts


def test_control_grpo_without_hook_shim_leaks_hooks_every_step(tmp_path):
    counts = run_ranks(
        _grpo_hooks_without_shim, 2, args=(str(tmp_path),), init="deepspeed", timeout=120, pg_timeout=20
    )[0]
    assert counts[1] >= counts[0] + 1, counts  # a rollout and a log-prob pass a step, a hook more each


def _compiled_grpo_graphs(tmpdir, shim: bool):
    """GRPO with torch_compile=True (Dynamo, eager backend: the guards without inductor's compile
    time) under ZeRO-3 and Zero3Safe, padded as under DeepCompile: Dynamo's unique graphs after
    each of 4 steps. ``shim=False`` removes the input-grad hook shim."""
    from fixtures import trl_jobs
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3._upstream import patches
    from hf_zero3.testing import tiny_tokenizer
    from hf_zero3.trl import DEEPCOMPILE_PAD_TO_MULTIPLE_OF

    graphs = trl_jobs.GraphCount()
    args = trl_jobs._args(
        GRPOConfig,
        tmpdir,
        num_generations=2,
        max_completion_length=GRPO_LEN,
        max_steps=4,
        torch_compile=True,
        torch_compile_backend="eager",
        pad_to_multiple_of=DEEPCOMPILE_PAD_TO_MULTIPLE_OF,
    )
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(
        model=trl_jobs._model(tok),
        reward_funcs=trl_jobs.length_reward,
        args=args,
        train_dataset=trl_jobs.chat_prompts(),
        processing_class=tok,
        callbacks=[hf_zero3.Zero3Safe(), graphs],
    )
    if not shim:
        assert patches.remove("transformers.PreTrainedModel.enable_input_require_grads: replace, not add")
    mark(f"training compiled GRPO (shim={shim})")
    trainer.train()
    return graphs.counts


@pytest.mark.parametrize("shim", [True, False])
def test_compiled_grpo_step_compiles_once(tmp_path, shim):
    """With the shim a compiled GRPO step compiles at step 1 and never again; without it (control)
    each rollout's leftover hook fails a Dynamo guard and the step recompiles."""
    g0, g1 = run_ranks(
        _compiled_grpo_graphs, 2, args=(str(tmp_path), shim), init="deepspeed", timeout=240, pg_timeout=60
    )
    assert g0 == g1 and len(g0) == 4 and g0[0] > 0
    if shim:
        assert len(set(g0)) == 1, g0
    else:
        assert g0[-1] > g0[0], g0


def _grpo_training_lengths(tmpdir, align: bool):
    """GRPO with rank 0's rows ending at their 2nd token (rank 1's run the budget): the sequence
    length of every training forward, with or without the group-length padding installed under
    DeepCompile (installed here by hand: DeepCompile needs CUDA)."""
    from fixtures import trl_jobs

    import hf_zero3
    from hf_zero3.trainer import trl_adapter as adapter

    trainer = trl_jobs.grpo_trainer(tmpdir, diverge_eos=True, callbacks=[hf_zero3.Zero3Safe()])
    if align:
        assert adapter.align_lengths(trainer)
    lengths = []

    def record(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            lengths.append(kwargs["input_ids"].shape[1])

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    mark(f"training (align={align})")
    trainer.train()
    out = trl_jobs._result(trainer)
    out["lengths"] = lengths
    return out


def _grpo_training_lengths_both(tmpdir):
    return {align: _grpo_training_lengths(f"{tmpdir}/{align}", align) for align in (False, True)}


def test_deepcompile_padding_gives_every_rank_the_same_shapes(tmp_path):
    """DeepCompile profiles a new graph with collectives (DeepSpeed #7611: ranks meeting new shapes
    at different steps hang): under it the padded tensors take the group's length, so every rank's
    training forward has the same shape, and the entropies are those of TRL's own padding. Control (the
    same job without it): the shapes differ per rank."""
    r0, r1 = run_ranks(
        _grpo_training_lengths_both, 2, args=(str(tmp_path),), init="deepspeed", timeout=240, pg_timeout=20
    )
    aligned, control = (r0[True], r1[True]), (r0[False], r1[False])
    assert len(aligned[0]["lengths"]) == len(aligned[1]["lengths"]) == STEPS
    assert aligned[0]["lengths"] == aligned[1]["lengths"], [r["lengths"] for r in aligned]
    assert all(a < b for a, b in zip(control[0]["lengths"], control[1]["lengths"])), [r["lengths"] for r in control]
    # GRPO's default loss here does not depend on the log-probs' values (one iteration: ratio 1); the
    # logged entropy (a masked mean over the model's outputs) does: the extra padding changes nothing
    entropy = [_log(r, "entropy") for r in (aligned[0], control[0])]
    assert len(entropy[0]) == STEPS and entropy[0] == pytest.approx(entropy[1], rel=1e-4), entropy
    assert aligned[0]["losses"] == pytest.approx(control[0]["losses"], rel=1e-4, abs=1e-6)


def test_control_grpo_eval_without_region_release_fails(tmp_path):
    with pytest.raises(DistributedFailure) as info:
        run_ranks(
            _grpo_eval_without_region_release, 2, args=(str(tmp_path),), init="deepspeed", timeout=180, pg_timeout=8
        )
    assert "Nested GatheredParameters" in str(info.value), str(info.value)


# -- completion logging: TRL splits the prompts unevenly across ranks -----------------------------
def _log_completions(tmpdir, fixed: bool):
    """GRPO with TRL's LogCompletionsCallback over 3 prompts, eval batch 1: rank 0 gets 2 prompts
    (2 generate() calls), rank 1 gets 1, after every step."""
    from fixtures import trl_jobs
    from trl import LogCompletionsCallback

    import hf_zero3

    trainer = trl_jobs.grpo_trainer(tmpdir, callbacks=[hf_zero3.Zero3Safe()] if fixed else [])
    trainer.args.per_device_eval_batch_size = 1
    trainer.eval_dataset = trl_jobs.chat_prompts(3)
    logger = LogCompletionsCallback(trainer, freq=1)
    # datasets 5 returns a Column, which accelerate's split_between_processes does not split (every
    # rank generates every prompt); a list (datasets < 4, or any list-backed eval set) is split
    # unevenly across ranks: the case the adapter pads
    logger.eval_dataset = {"prompt": list(trainer.eval_dataset["prompt"])}
    trainer.add_callback(logger)
    mark(f"training with completion logging (fixed={fixed})")
    trainer.train()
    out = trl_jobs._result(trainer)
    out["logged"] = len(logger.table)
    return out


def test_completion_logging_pads_the_uneven_split(tmp_path):
    r0, r1 = run_ranks(_log_completions, 2, args=(str(tmp_path), True), init="deepspeed", timeout=200, pg_timeout=20)
    assert r0["generate_calls"] == r1["generate_calls"]  # rank 1 generates a padding prompt too
    assert r0["forwards_per_call"] == r1["forwards_per_call"]
    assert r0["logged"] == 3 * STEPS  # the padding's completion is dropped: 3 prompts a step
    assert r0["generate_calls"] == STEPS * (1 + 2)  # a rollout and 2 logging calls (batch 1) a step


def test_control_completion_logging_without_fix_fails(tmp_path):
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_log_completions, 2, args=(str(tmp_path), False), init="deepspeed", timeout=60, pg_timeout=8)
    assert "ok" not in info.value.outcomes.values(), info.value.outcomes


# -- DeepSpeed HybridEngineRollout ---------------------------------------------------------------
class _TokenizerStandIn:
    """HybridEngineRollout.generate (and hf_zero3.trl.early_stop) read only ``eos_token_id`` and
    ``pad_token_id`` from the tokenizer on the default ``model.generate()`` path."""

    def __init__(self, eos_token_id, pad_token_id):
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id


ROLLOUT_STEPS = 24


def _rollout_run():
    import torch.distributed as dist
    from _zero3_workers import ForwardCounter, build_engine
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
    from fixtures.scenarios import find_eos_scenario

    import hf_zero3.trl

    torch.set_num_threads(1)  # two ranks share a small CPU
    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)  # engine only: transformers cannot see ZeRO-3
    sc = find_eos_scenario(ref, steps=ROLLOUT_STEPS, early_by=8)
    early = sorted(sc.early, key=lambda e: e[1])  # same on every rank (same reference weights)
    assert len(early) >= 3 and early[0][1] < early[-1][1], early
    # rank 0: the two earliest; rank 1: the latest alone -> every row of every rank hits EOS early
    mine = early[:2] if rank == 0 else early[-1:]
    prompts = torch.tensor([p for p, _ in mine])
    request = RolloutRequest(prompt_ids=prompts, prompt_attention_mask=torch.ones_like(prompts))
    rollout = HybridEngineRollout(engine, _TokenizerStandIn(sc.eos_token_id, pad_token_id=0))
    counter = ForwardCounter(engine.module)
    greedy = SamplingConfig(max_new_tokens=ROLLOUT_STEPS, temperature=0.0)
    sample = SamplingConfig(max_new_tokens=ROLLOUT_STEPS, temperature=1.0)

    def run(name, sampling):
        mark(f"rollout {name}")
        torch.manual_seed(1234)
        batch = rollout.generate(request, sampling)
        stats = getattr(engine.module, "hf_zero3_last_generate", None)
        return dict(
            input_ids=batch.input_ids.tolist(),
            attention_mask=batch.attention_mask.tolist(),
            response_start_idx=batch.response_start_idx.tolist(),
            forwards=counter.take(),
            stats_forwards=getattr(stats, "forwards", None),
        )

    out = {"eos_steps": [s for _, s in mine], "prompt_len": prompts.shape[1]}
    out["plain_greedy"] = run("plain greedy", greedy)
    out["plain_sample"] = run("plain sample", sample)
    hf_zero3.trl.early_stop(rollout)
    out["fixed_greedy"] = run("early-stop greedy", greedy)
    out["fixed_sample"] = run("early-stop sample", sample)
    # the same rollout through hf_zero3's compiled static loop (the model gathered for the call)
    hf_zero3.lockstep(engine, sync_every=1, gather="all", decode="compiled")
    out["loop_greedy"] = run("early-stop greedy, static loop", greedy)
    out["loop_greedy"]["loop"] = engine.module.hf_zero3_last_generate.loop
    out["loop_sample"] = run("early-stop sample, static loop", sample)
    out["loop_sample"]["loop"] = engine.module.hf_zero3_last_generate.loop
    return out


@pytest.fixture(scope="module")
def rollout_results():
    return run_ranks(_rollout_run, 2, timeout=300, pg_timeout=20)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_rollout_early_stop_keeps_outputs(rollout_results, mode):
    for res in rollout_results:
        plain, fixed, loop = res[f"plain_{mode}"], res[f"fixed_{mode}"], res[f"loop_{mode}"]
        assert loop["loop"] == "hf_zero3", loop
        for key in ("input_ids", "attention_mask", "response_start_idx"):
            assert fixed[key] == plain[key], key
            assert loop[key] == plain[key], key
        assert len(plain["input_ids"][0]) == res["prompt_len"] + ROLLOUT_STEPS


def test_rollout_early_stop_stops_at_the_groups_last_eos(rollout_results):
    r0, r1 = rollout_results
    longest = max(r0["eos_steps"] + r1["eos_steps"])
    assert longest < ROLLOUT_STEPS and r0["eos_steps"] != r1["eos_steps"]
    # plain: DeepSpeed ignores EOS, every rank runs the full budget
    assert r0["plain_greedy"]["forwards"] == r1["plain_greedy"]["forwards"] == ROLLOUT_STEPS
    # early stop (sync_every=1): the forward that produced the group's last EOS is the last one
    assert r0["fixed_greedy"]["forwards"] == r1["fixed_greedy"]["forwards"] == longest
    assert r0["fixed_greedy"]["stats_forwards"] == longest
    # the static loop checks late (each check on the previous one's flags): one step more here
    assert r0["loop_greedy"]["stats_forwards"] == r1["loop_greedy"]["stats_forwards"] == min(ROLLOUT_STEPS, longest + 1)
    # each rank's rows did end early in the plain output too (EOS kept, padding after it)
    for res in rollout_results:
        start = res["plain_greedy"]["response_start_idx"][0]
        for row, step in zip(res["plain_greedy"]["attention_mask"], res["eos_steps"]):
            assert sum(row[start:]) == step


def test_rollout_sampling_forwards_agree(rollout_results):
    r0, r1 = rollout_results
    assert r0["plain_sample"]["forwards"] == r1["plain_sample"]["forwards"] == ROLLOUT_STEPS
    assert r0["fixed_sample"]["forwards"] == r1["fixed_sample"]["forwards"] <= ROLLOUT_STEPS
