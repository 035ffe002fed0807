"""A Mistral through the static loop on real GPUs (marked gpu): with its default config (a
4096-token sliding window) its sliding-window cache layers run as static layers for a call that
fits in the window; with a 16-token window they slide as rings. Either way the decode steps
captured in CUDA graphs give the tokens of the same steps run one by one, each the eager forward's
argmax within the bf16 tolerance (teacher-forced, over the model's own window mask)."""

import pytest
from _launch import run as _run

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_a_sliding_window_model_decodes_in_cuda_graphs():
    from _decode_workers import check_graphs_replay_the_steps, eager_step_graphs

    res = _run(eager_step_graphs, 40, False, True, timeout=500)
    for r in res:
        g = r["graphs"]
        assert g["loop"] == "hf_zero3" and g["reason"] is None and g["step"] == "eager", g
        assert g["compiles"] == 0, g
        assert g["mlp_kernels"] == 4, g  # Mistral's MLPs through hf_zero3's kernels
        assert g["norm_kernels"] == 9 and g["rotary_kernel"], g  # its norms and rotary embedding too
    check_graphs_replay_the_steps(res, "eager")


@pytest.mark.timeout(600)
def test_a_window_shorter_than_the_call_slides_as_a_ring_in_cuda_graphs():
    from _decode_workers import check_graphs_replay_the_steps, eager_step_graphs

    res = _run(eager_step_graphs, 40, False, True, 16, timeout=500)  # prompts of 24-28 tokens + 40 new
    for r in res:
        g = r["graphs"]
        assert g["loop"] == "hf_zero3" and g["reason"] is None and g["step"] == "eager", g
        assert g["ring_layers"] == 4, g  # every layer of small_mistral_config slid as a ring
    check_graphs_replay_the_steps(res, "eager")
