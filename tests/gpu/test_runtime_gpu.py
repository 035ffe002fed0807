"""Issues #11 and #12 on real GPUs (marked gpu; `make gpu-test`): two DeepCompile engines in one
process each keep their own memory plan; a TRL GRPO policy under DeepCompile trains, generates
between steps and evaluates without recompiling its training graphs."""

import math

import pytest
from _launch import run as _run

pytestmark = pytest.mark.gpu


def test_two_deepcompile_engines_keep_their_own_plan():
    from _runtime_workers import two_deepcompile_engines

    for r in _run(two_deepcompile_engines):
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 4
        assert r["own"] == (True, True, True)
        assert r["policy_plan"]["graphs"] >= 2  # the policy's graphs went to the policy's plan
        assert r["reference_plan"]["graphs"] == 0  # the evaluated reference never entered its graph
        assert max(r["diffs"]) < 0.1, r["diffs"]


# Guards against the failures this path has had: TRL's fused LM head outside DeepCompile's graphs
# (hf_zero3.trainer.trl_fused_head is the fix), TRL's gather for generation inside evaluate meeting Zero3Safe's
# eval region, and a recompile every step (sequence length; transformers' input-grad hook leak).
@pytest.mark.timeout(600)
def test_trl_grpo_under_deepcompile_trains_generates_and_evaluates(tmp_path):
    from _runtime_workers import grpo_deepcompile

    for r in _run(grpo_deepcompile, str(tmp_path), timeout=560):
        assert r["deepcompile"] and r["plan"] and r["plan"]["graphs"] >= 2, r
        assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"])
        assert len(r["evals"]) >= 2
        assert r["gather"] == "held"  # TRL's gathered model reused, DeepCompile's graph bypassed
        assert r["graphs"][-1] == r["graphs"][0], (r["graphs"], r["recompiles"])  # compiled at step 0, never again


@pytest.mark.timeout(400)
def test_trl_grpo_rollouts_run_the_static_loop_with_cuda_graphs(tmp_path):
    from _runtime_workers import grpo_compiled_decode

    from hf_zero3.decode.gqa_attention import KERNEL, NAME

    res = _run(grpo_compiled_decode, str(tmp_path), timeout=380)
    print(
        "rollouts:", [[(g["loop_reused"], g["reused"], g["forwards"], g["reason"]) for g in r["rollouts"]] for r in res]
    )  # for the record
    for r in res:
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r
        for g in r["rollouts"]:
            assert g["loop"] == "hf_zero3" and g["decode"] == "compiled", g
            assert g["graph_steps"] > 0 and g["attention"] in (NAME, KERNEL), (
                g
            )  # grouped heads (Triton at >= 1 program per SM)
    assert len({tuple(g["forwards"] for g in r["rollouts"]) for r in res}) == 1  # lockstep across ranks
