"""TRL's generating trainers (GRPO, with LoRA too, RLOO, GKD, GOLD, DistillationTrainer, SDFT,
SDPO) with ``Zero3Safe`` on 2 gloo ranks under strict ZeRO-3: every rollout decodes through
hf_zero3's static loop, with the same fp32 tokens as TRL's own path (the same trainer without
``Zero3Safe``), seeded sampling included, and the same losses.

On CUDA ``Zero3Safe()``'s ``decode="auto"`` takes the static loop in these rollouts (TRL's
``disable_compile`` keeps only transformers' compiled loop off); on CPU "auto" decodes eagerly, so
the test asks for ``decode="compiled"``. The prompt's forward and the decode steps run eagerly,
the rollouts' defaults (``DecodeOptions.compile_prefill``, ``DecodeOptions.compile_step``). Both
passes of a trainer run in one process: the second trainer's model is built with the same seed,
and TRL seeds its sampling alike."""

import pytest

from hf_zero3.testing import mark, run_ranks

TRAINERS = ("grpo", "grpo_lora", "rloo", "gkd", "gold", "distillation", "sdft", "sdpo")


def _both_ways(tmpdir: str) -> dict:
    from fixtures import trl_jobs

    import hf_zero3

    builders = {
        "grpo": trl_jobs.grpo_trainer,
        "grpo_lora": lambda d, callbacks: trl_jobs.grpo_trainer(d, peft=True, callbacks=callbacks),
        "rloo": trl_jobs.rloo_trainer,
        # lmbda=1: every step draws on-policy (GKD's own default 0.5 may draw no rollout at all)
        "gkd": lambda d, callbacks: trl_jobs.gkd_trainer(d, lmbda=1.0, divergent_draws=False, callbacks=callbacks),
        "gold": trl_jobs.gold_trainer,
        "distillation": trl_jobs.distillation_trainer,
        "sdft": trl_jobs.sdft_trainer,
        "sdpo": trl_jobs.sdpo_trainer,
    }
    out = {}
    for name in TRAINERS:
        out[name] = {}
        for way, callbacks in (("trl", []), ("hf_zero3", [hf_zero3.Zero3Safe(decode="compiled")])):
            mark(f"{name}: {way}")
            trainer = builders[name](f"{tmpdir}/{name}-{way}", callbacks=callbacks)
            trainer.args.max_steps = 1  # one rollout a trainer: the loop's reuse is test_static_loop's
            trainer.train()
            res = trl_jobs._result(trainer)
            out[name][way] = {k: res[k] for k in ("tokens", "loops", "losses")}
            rt = hf_zero3.runtime_of(trainer.model, create=False)
            last = rt.generation.last if rt is not None else None
            out[name][way]["prefill"] = last.prefill if last is not None else None
            out[name][way]["step"] = last.step if last is not None else None
    mark("done")
    return out


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_fast")
    return run_ranks(_both_ways, 2, args=(str(tmp),), init="deepspeed", timeout=540, pg_timeout=60)


@pytest.mark.parametrize("name", TRAINERS)
def test_rollouts_take_the_static_loop_with_trls_tokens(both_ways, name):
    for rank, r in enumerate(both_ways):
        trl, ours = r[name]["trl"], r[name]["hf_zero3"]
        assert ours["loops"] and {loop for loop, _ in ours["loops"]} == {"hf_zero3"}, (rank, ours["loops"])
        assert len(ours["tokens"]) == len(trl["tokens"]) > 0, rank
        assert ours["tokens"] == trl["tokens"], rank
        # a rollout's prompt forward and decode steps run eagerly by default
        # (DecodeOptions.compile_prefill, DecodeOptions.compile_step)
        assert ours["prefill"] == "eager" and ours["step"] == "eager", (rank, ours["prefill"], ours["step"])
        assert ours["losses"] == pytest.approx(trl["losses"], rel=1e-5, abs=1e-6), rank
