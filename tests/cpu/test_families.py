"""A family's part of the fast decode path runs only while transformers' function is the source it
was checked against: a release that changes the MLP's or the attention's math makes that part fall
back to the model's own code, with the reason in the call's report."""

import pytest
import torch

from hf_zero3._upstream import transformers as hf_up
from hf_zero3.decode import families, gqa_attention, mlp_kernels


@pytest.fixture()
def model():
    from hf_zero3.testing import models

    return models.plain_model(models.tiny_llama_config(attn_implementation="sdpa")).to(torch.bfloat16)


def test_the_installed_transformers_is_the_checked_source():
    """Fails when a transformers upgrade changes a replaced function: read the new source against
    the decode path's kernels, then record its fingerprint in _upstream.transformers.CHECKED_SOURCES."""
    for path in hf_up.CHECKED_SOURCES:
        assert hf_up.unchecked_reason(path) is None, hf_up.unchecked_reason(path)
    assert all(
        p in hf_up.CHECKED_SOURCES
        for f in families.FAMILIES.values()
        for p in f.mlp + f.fused_mlp + f.rope_attention + f.norm + f.rotary
    )


def test_the_fingerprint_ignores_comments_docstrings_and_layout_but_not_the_math():
    def a(x):
        """Doc."""
        return x * 2  # twice

    def b(x):
        return x * 2

    def c(x):
        return x * 3

    assert hf_up.source_fingerprint(a) == hf_up.source_fingerprint(b) != hf_up.source_fingerprint(c)


def test_a_changed_mlp_forward_falls_back_to_the_models_own(model, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = model.model.layers[0].mlp
    assert mlp_kernels.applies(mlp) and families.fallbacks(model) == ()

    def forward(self, x):  # a release that swaps gate and up: not what the kernel computes
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    monkeypatch.setattr(LlamaMLP, "forward", forward)
    assert not mlp_kernels.applies(mlp)
    (reason,) = families.fallbacks(model)
    assert "LlamaMLP.forward is not the code hf_zero3 was checked against" in reason


def test_a_changed_rotary_helper_turns_the_rope_kernel_off(model, monkeypatch):
    from transformers.models.llama import modeling_llama

    layers = model.config.num_hidden_layers
    assert len(gqa_attention.rope_plan(model, gqa_attention.KERNEL)) == layers

    def rotate_half(x):  # interleaved pairs instead of halves
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    monkeypatch.setattr(modeling_llama, "rotate_half", rotate_half)
    assert gqa_attention.rope_plan(model, gqa_attention.KERNEL) == ()
    assert any("rotate_half" in r for r in families.fallbacks(model))
    assert mlp_kernels.applies(model.model.layers[0].mlp)  # the MLP's source is unchanged
