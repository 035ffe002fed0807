"""TRL's GRPO with ``Zero3Safe()`` on GPUs (marked gpu): its rollouts take hf_zero3's static loop
by default (TRL's ``disable_compile`` notwithstanding), under plain ZeRO-3 and beside DeepCompile's
training graphs, which do not recompile; evaluation (GRPO generates for every eval batch) still
runs; a call the loop cannot take decodes eagerly, not through transformers' compiled loop."""

import pytest
from _launch import run as _run

from hf_zero3.generation.config import COMPILED_SYNC_EVERY

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("deepcompile", [False, True])
def test_grpo_rollouts_take_the_static_loop_by_default(tmp_path, deepcompile):
    from _trl_workers import grpo_rollouts

    for r in _run(grpo_rollouts, str(tmp_path), deepcompile, timeout=540):
        assert r["loops"] and {loop for loop, _ in r["loops"]} == {"hf_zero3"}, r["loops"]
        assert r["decode"] == "compiled" and r["sync_every"] == COMPILED_SYNC_EVERY and r["late_checks"], r
        # a rollout's prompt forward runs eagerly by default (DecodeOptions.compile_prefill); compiled
        # on left-padded prompts under DeepCompile: test_padded_prompts_prefill_compiled_under_deepcompile
        assert r["prefill"] == "eager" and r["prefill_reason"] is None, r
        # and its decode steps run the model's forward, captured in CUDA graphs (DecodeOptions.compile_step)
        assert r["step"] == "eager" and r["graph_steps"] > 0, r
        assert r["eval_logs"] == 2 and r["evals"] and r["finite"], r
        # the training graphs (DeepCompile's, or none) and the decode graphs compile in steps 1-2
        assert r["graphs"][-1] == r["graphs"][-2], r["graphs"]
        # DeepCompile resets Dynamo when it launches its passes; that reset comes before the first
        # rollout compiles the loop, so it discards none of the loop's graphs (later rollouts reuse them)
        assert not any(r["resets"]) and (r["resets"] or not deepcompile), r["resets"]


def test_grpo_rollout_the_loop_cannot_take_decodes_eagerly(tmp_path):
    """A Python logits processor (the harness's EOS script): TRL's disable_compile then holds."""
    from _trl_workers import grpo_rollouts

    for r in _run(grpo_rollouts, str(tmp_path), False, "eos", timeout=420):
        assert {loop for loop, _ in r["loops"]} == {"transformers"}, r["loops"]
        assert r["decode"] == "eager" and "disable_compile=True (GRPOTrainer)" in r["decode_reason"], r
        assert r["finite"], r
