"""The static loop's decode attention (GQA heads grouped, the KV cache read once) against
transformers' own eager and SDPA attention on a real Llama attention module, fp32."""

import pytest
import torch


@pytest.fixture(scope="module")
def attn():
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config())  # 4 query heads, 2 key/value heads
    return model, model.model.layers[0].self_attn


def _inputs(seed=0, q_len=1, length=10, batch=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, q_len, 8, generator=g)
    k = torch.randn(batch, 2, length, 8, generator=g)
    v = torch.randn(batch, 2, length, 8, generator=g)
    keep = torch.ones(batch, 1, q_len, length, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding
    keep[1, ..., 7:] = False  # cache slots not filled yet
    return q, k, v, keep


def test_decode_attention_equals_transformers_eager_and_sdpa(attn):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from hf_zero3.decode.gqa_attention import attention

    _, module = attn
    q, k, v, keep = _inputs()
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    ours, weights = attention(module, q, k, v, keep, scaling=module.scaling)
    eager, _ = eager_attention_forward(module, q, k, v, additive, scaling=module.scaling)
    sdpa, _ = sdpa_attention_forward(module, q, k, v, keep, scaling=module.scaling)
    assert weights is None and ours.shape == eager.shape == (3, 1, 4, 8)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-6)
    # an additive (eager-style) mask gives the same result as the boolean one
    torch.testing.assert_close(attention(module, q, k, v, additive, scaling=module.scaling)[0], ours)


def test_other_shapes_are_transformers_sdpa(attn):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_zero3.decode.gqa_attention import attention

    _, module = attn
    q, k, v, keep = _inputs(q_len=4)  # a prompt, not one decode token
    torch.testing.assert_close(
        attention(module, q, k, v, keep, scaling=module.scaling)[0],
        sdpa_attention_forward(module, q, k, v, keep, scaling=module.scaling)[0],
    )


def test_applies_to_grouped_and_multi_head_models_and_use_restores_the_config(attn):
    from hf_zero3.decode import gqa_attention
    from hf_zero3.testing import models

    model, _ = attn
    assert gqa_attention.applies(model)
    mha = models.plain_model(models.tiny_llama_config(num_key_value_heads=4))
    assert gqa_attention.applies(mha) and gqa_attention.multi_head(mha)
    # one head per group: the kernel or the model's own attention, never the PyTorch form (SDPA's twin)
    assert gqa_attention.choice(mha, "cpu", 64, "auto") in (None, gqa_attention.KERNEL)
    assert gqa_attention.choice(mha, "cpu", 64, "off") is None
    assert gqa_attention.choice(model, "cpu", 64, "off") == gqa_attention.NAME
    model.config.attn_logit_softcapping = 30.0  # soft-capped logits (Gemma 2/3): the model's own attention
    try:
        assert not gqa_attention.applies(model)
    finally:
        del model.config.attn_logit_softcapping
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="inside"):
        with gqa_attention.use(model):
            assert model.config._attn_implementation == gqa_attention.NAME
            ids = torch.tensor([[3, 4, 5]])
            with torch.no_grad():
                model(input_ids=ids)  # a prompt through the registered name: SDPA, with its mask
            raise RuntimeError("inside")
    assert model.config._attn_implementation == before
