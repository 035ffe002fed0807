"""The Triton decode-attention kernel (hf_zero3.kernels.gqa_decode) run by Triton's interpreter on
CPU, float32, against the PyTorch form it replaces on GPU and, through a real Llama model with a
static cache, against the model's own attention. (The interpreter's bf16 ``tl.dot`` is not
exact; bf16 runs in the GPU test.)"""

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="a GPU host: tests/gpu runs the kernel compiled (conftest sets the interpreter "
                                       "on CPU-only hosts)")


@pytest.fixture(autouse=True)
def switch_on(monkeypatch):
    from hf_zero3.kernels import gqa_decode

    monkeypatch.delenv("HF_ZERO3_TRITON_ATTENTION", raising=False)
    assert gqa_decode.load() is not None, gqa_decode.unavailable_reason()  # built interpreted


def _case(seed, batch, heads, kv, dim, length, dim_v=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k = torch.randn(batch, kv, length, dim, generator=g)
    v = torch.randn(batch, kv, length, dim_v or dim, generator=g)
    keep = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    for i in range(batch):
        keep[i, ..., 3 * i: max(3 * i + 1, length - 70 - i)] = True  # left padding, an unfilled tail
    return q, k, v, keep


@pytest.mark.parametrize("batch,heads,kv,dim,length,dim_v", [
    (3, 8, 2, 16, 70, None),    # a tail block with no position to attend (skipped)
    (2, 12, 4, 64, 200, None),  # four blocks, the last partly outside the cache
    (1, 6, 3, 80, 33, None),    # a head dim that is no power of two, one block
    (2, 4, 4, 16, 20, None),    # one query head per key/value head
    (2, 8, 2, 32, 90, 16),      # a value head dim of its own
])
def test_kernel_equals_the_pytorch_form(batch, heads, kv, dim, length, dim_v):
    from hf_zero3.generation.decode_attention import attention
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(batch + length, batch, heads, kv, dim, length, dim_v)
    assert gqa_decode.supports(q, k, v, keep)
    scale = dim ** -0.5
    ref, _ = attention(None, q, k, v, keep, scaling=scale) if kv < heads else (None, None)
    if ref is None:  # the PyTorch form hands one-head groups to SDPA: compare with plain math
        scores = (q @ k.transpose(2, 3)) * scale
        ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
        ref = ref.transpose(1, 2)
    out = gqa_decode.gqa_decode_attention(q, k, v, keep, scale)
    assert out.shape == ref.shape == (batch, 1, heads, (dim_v or dim))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    torch.testing.assert_close(gqa_decode.gqa_decode_attention(q, k, v, additive, scale), ref, rtol=1e-5, atol=1e-5)
    # one mask row for every row; no mask: every position
    torch.testing.assert_close(gqa_decode.gqa_decode_attention(q, k, v, keep[:1], scale),
                               gqa_decode.gqa_decode_attention(q, k, v, keep[:1].expand_as(keep), scale))
    everything = torch.ones_like(keep)
    torch.testing.assert_close(gqa_decode.gqa_decode_attention(q, k, v, None, scale),
                               gqa_decode.gqa_decode_attention(q, k, v, everything, scale), rtol=1e-6, atol=1e-6)


def test_unsupported_shapes_and_the_switch(monkeypatch):
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(0, 2, 8, 2, 16, 10)
    assert not gqa_decode.supports(q.expand(2, 8, 3, 16), k, v, keep)  # a prompt, not one token
    assert not gqa_decode.supports(q, k, v, keep.expand(2, 8, 1, 10))  # a mask per head
    assert not gqa_decode.supports(q[:, :7], k, v, keep)  # heads not a multiple of key/value heads
    monkeypatch.setitem(gqa_decode._state, "interpret", False)
    assert not gqa_decode.supports(q, k, v, keep)  # CPU tensors, a kernel built for the GPU
    monkeypatch.setenv("HF_ZERO3_TRITON_ATTENTION", "0")
    assert gqa_decode.unavailable_reason() == "disabled by HF_ZERO3_TRITON_ATTENTION=0"
    assert not gqa_decode.is_available()


def test_a_llama_decode_step_through_the_kernel_matches_its_own_attention():
    """A real Llama (GQA, sdpa) with transformers' StaticCache: the decode step's logits through
    the kernel, registered as transformers attention (with the mask transformers builds for
    that cache: left padding, unfilled positions), equal the model's own."""
    from transformers import StaticCache

    from hf_zero3.generation import decode_attention
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config())
    assert decode_attention.applies(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = {}
    for name in (None, decode_attention.KERNEL):
        cache = StaticCache(config=model.config, max_cache_len=80)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            positions = (step_mask.cumsum(-1) - 1)[:, -1:]
            with decode_attention.use(model, name):
                out = model(input_ids=torch.tensor([[11], [12]]), attention_mask=step_mask, position_ids=positions,
                            past_key_values=cache, use_cache=True)
        logits[name] = out.logits
    torch.testing.assert_close(logits[decode_attention.KERNEL], logits[None], rtol=1e-5, atol=1e-5)


def test_the_kernel_is_chosen_where_it_has_a_program_per_sm(monkeypatch):
    """Measured on one H200: faster than the PyTorch form at batch 64 (512 programs), slower at
    batch 8 (64 programs, fewer than its 132 SMs)."""
    from hf_zero3.generation import decode_attention
    from hf_zero3.kernels import gqa_decode
    from hf_zero3.testing import models

    monkeypatch.setitem(gqa_decode._state, "min_programs", 132)
    assert not gqa_decode.pays(8, 8) and gqa_decode.pays(64, 8)
    monkeypatch.setenv("HF_ZERO3_TRITON_ATTENTION", "always")
    assert gqa_decode.pays(8, 8)
    model = models.plain_model(models.tiny_llama_config())
    assert decode_attention.choice(model, "cpu", 64) == decode_attention.NAME  # the kernel is for CUDA
    mha = models.plain_model(models.tiny_llama_config(num_key_value_heads=4))
    assert decode_attention.choice(mha, "cpu", 64) is None  # not grouped: the model's own attention


def test_masks_and_dtypes_it_does_not_take():
    from hf_zero3.kernels import gqa_decode

    q, k, v, keep = _case(1, 2, 8, 2, 16, 10)
    assert not gqa_decode.supports(q, k, v, keep[..., :9])  # shorter than the cache
    assert not gqa_decode.supports(q, k, v, keep.expand(2, 1, 1, 10).repeat(2, 1, 1, 1))  # another batch
    assert not gqa_decode.supports(q, k.double(), v, keep)  # key/value in another dtype than the query
