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
        assert g["norm_kernels"] == 9, g  # two norms a layer and the final one, one kernel each
        assert not g["rotary_kernel"], g  # the rope kernel rotates q and k inside the attention
    check_graphs_replay_the_steps(res, "eager")


def test_the_norm_kernel_rounds_bf16_as_transformers_rmsnorm():
    """Compiled for the GPU, the kernel's bf16 rows equal transformers' RMSNorm's bit for bit but
    where the two sums of squares round apart (one bf16 step, a few elements)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_zero3.kernels import rms_norm

    for n in (896, 2048, 4096):
        g = torch.Generator().manual_seed(n)
        norm = LlamaRMSNorm(n, eps=1e-6).to("cuda", torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=g))
            x = (3 * torch.randn(64, n, generator=g)).to("cuda", torch.bfloat16)
            own = norm(x)
        ours = rms_norm.load()(x, norm.weight.detach(), norm.variance_epsilon)
        step = own.float().abs() * 2.0**-7
        assert bool(((ours.float() - own.float()).abs() <= step).all()), n
        assert (ours == own).float().mean().item() > 0.99, n


def test_the_rotary_kernel_equals_apply_rotary_pos_emb_bit_for_bit():
    """Compiled for the GPU, the kernel rounds each product and the sum as the eager ops do: its
    bf16 output equals transformers' ``apply_rotary_pos_emb``, for q and k as the attention
    forwards pass them (transposed views of the projections) and per-row positions."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from hf_zero3.kernels import rotary

    g = torch.Generator().manual_seed(0)
    for b, s, hq, hk, d in ((64, 1, 14, 2, 64), (8, 1, 32, 8, 128), (3, 17, 4, 2, 128)):
        q = torch.randn(b, s, hq, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, s, hk, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
        angles = torch.randn(b, s, d, generator=g).to("cuda")
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        own_q, own_k = apply_rotary_pos_emb(q, k, cos, sin)
        ours_q, ours_k = rotary.load()(q, cos, sin), rotary.load()(k, cos, sin)
        assert torch.equal(ours_q, own_q) and torch.equal(ours_k, own_k), (b, s, hq, d)
