"""An eager decode step's rotary embedding through hf_zero3's Triton kernel
(hf_zero3.decode.rotary_kernel, hf_zero3.kernels.rotary), run by Triton's interpreter on CPU in
float32 and bfloat16 (the kernel rounds to bfloat16 in integer operations, which the interpreter
runs as the GPU does: its outputs equal the eager ops' to the bit): the kernel against
transformers' ``apply_rotary_pos_emb``, the replacement's fallbacks, a whole forward with it, and
which models take it."""

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a GPU host: the GPU tests run the kernel compiled (conftest sets the interpreter on CPU-only hosts)",
)


def _qkcs(b, s, hq, hk, d, cos_batch=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).transpose(1, 2)  # as the attention forwards pass them
    k = torch.randn(b, s, hk, d, generator=g).to(dtype).transpose(1, 2)
    angles = torch.randn(cos_batch or b, s, d, generator=g)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("shape", [(4, 1, 6, 2, 16), (2, 5, 4, 4, 64), (3, 2, 2, 1, 10)])
def test_the_kernel_equals_apply_rotary_pos_emb(shape):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_zero3.kernels import rotary

    q, k, cos, sin = _qkcs(*shape)
    own_q, own_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotate = rotary.load()
    torch.testing.assert_close(rotate(q, cos, sin), own_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotate(k, cos, sin), own_k, rtol=1e-6, atol=1e-6)
    # one cos/sin row for every batch row (position ids shared)
    q, k, cos, sin = _qkcs(*shape, cos_batch=1)
    torch.testing.assert_close(rotate(q, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rotate takes"):
        rotate(q, cos[..., :-2], sin[..., :-2])


@pytest.mark.parametrize("shape", [(64, 1, 14, 2, 64), (3, 17, 4, 2, 128)])
def test_the_kernel_rounds_bf16_as_the_eager_ops_do(shape):
    """Each product and the sum rounded to bfloat16 (ties to even) as transformers' eager ops
    round them: equal to the bit, not within a tolerance."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_zero3.kernels import rotary

    q, k, cos, sin = _qkcs(*shape, dtype=torch.bfloat16)
    own_q, own_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotate = rotary.load()
    assert torch.equal(rotate(q, cos, sin), own_q) and torch.equal(rotate(k, cos, sin), own_k)
    assert not rotary.fits(q.half(), cos.half(), sin.half())  # float16: left to the eager ops


def test_the_replacement_hands_what_the_kernel_cannot_take_to_the_function_it_replaced():
    from transformers.models.qwen2 import modeling_qwen2

    from hf_zero3.decode import rotary_kernel

    own = modeling_qwen2.apply_rotary_pos_emb
    replaced = rotary_kernel.Replaced("transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb")
    q, k, cos, sin = _qkcs(2, 3, 4, 2, 8)
    with replaced.use():
        ours = modeling_qwen2.apply_rotary_pos_emb
        assert ours is not own
        torch.testing.assert_close(ours(q, k, cos, sin)[0], own(q, k, cos, sin)[0], rtol=1e-6, atol=1e-6)
        assert replaced.hits == 1
        # unsqueeze_dim=2 (the heads after the positions), mixed dtypes: the function it replaced
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        torch.testing.assert_close(ours(qt, kt, cos, sin, unsqueeze_dim=2), own(qt, kt, cos, sin, unsqueeze_dim=2))
        torch.testing.assert_close(ours(q.double(), k.double(), cos, sin), own(q.double(), k.double(), cos, sin))
        assert replaced.hits == 1
    assert modeling_qwen2.apply_rotary_pos_emb is own  # restored


def test_a_forward_with_the_rotary_replaced_equals_its_own_and_which_models_take_it():
    from transformers.models.qwen2 import modeling_qwen2

    from hf_zero3.decode import families, rotary_kernel
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_qwen2_config()).eval()
    path = families.rotary_function(model)
    assert path == "transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb"
    assert rotary_kernel.plan(model, "cpu") is None  # CUDA only
    for name in ("tiny_llama_config", "tiny_mistral_config"):
        assert families.rotary_function(models.plain_model(getattr(models, name)())) is not None
    for name in ("tiny_phi3_config", "tiny_gemma3_config", "tiny_qwen3_moe_config"):  # other math, or no family
        assert families.rotary_function(models.plain_model(getattr(models, name)())) is None
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    replaced, before = rotary_kernel.Replaced(path), modeling_qwen2.apply_rotary_pos_emb
    with torch.no_grad():
        own = model(ids).logits
        with replaced.use():
            ours = model(ids).logits
    assert replaced.hits == model.config.num_hidden_layers
    assert modeling_qwen2.apply_rotary_pos_emb is before  # restored
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-5)
