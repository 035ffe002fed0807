"""The static loop's decode steps without torch.compile (``DecodeOptions(compile_step=False)``, the
default in TRL rollouts) on real GPUs (marked gpu): the model's forward with hf_zero3's kernels,
captured in CUDA graphs, gives the tokens of the same steps run one by one, each the eager
forward's argmax within the bf16 tolerance (teacher-forced), and compiles nothing."""

import pytest
from _launch import run as _run

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_eager_steps_in_cuda_graphs_match_the_steps_run_one_by_one():
    from _decode_workers import check_graphs_replay_the_steps, eager_step_graphs

    res = _run(eager_step_graphs, timeout=500)
    for r in res:
        g = r["graphs"]
        assert g["loop"] == "hf_zero3" and g["decode"] == "compiled" and g["step"] == "eager", g
        assert g["prefill"] == "eager" and g["compiles"] == 0, g  # nothing compiled, not even the greedy tail
        assert g["rope_attention"] == 4 and g["split_k"] == 8, g  # hf_zero3's kernels, launched eagerly
    check_graphs_replay_the_steps(res, "eager")
