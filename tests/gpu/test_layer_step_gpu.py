"""The compiled decode step as one compiled decoder layer that every layer runs
(``DecodeOptions(compile_layers=True)``) on a real GPU (marked gpu): with hf_zero3's kernels inside
it (the rope kernel, split-K GEMMs, dependent launches), one graph serves the model's four layers,
and the steps captured in CUDA graphs give the tokens of the same steps run one by one, each the
eager forward's argmax within the bf16 tolerance (teacher-forced)."""

import pytest
from _launch import run as _run

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_one_compiled_layer_serves_every_layer_in_cuda_graphs():
    from _decode_workers import check_graphs_replay_the_steps, eager_step_graphs

    res = _run(eager_step_graphs, 40, True, timeout=500)
    for r in res:
        g, plain = r["graphs"], r["plain"]
        assert g["loop"] == "hf_zero3" and g["decode"] == "compiled" and g["step"] == "layers", g
        assert g["compiled_layers"] == 4, g
        # one graph for the four layers, and the greedy tail
        assert g["prefill"] == "eager" and g["compiles"] == 2 and plain["compiles"] == 0, (g, plain)
        assert g["rope_attention"] == 4 and g["split_k"] == 8, g
    check_graphs_replay_the_steps(res, "layers")
