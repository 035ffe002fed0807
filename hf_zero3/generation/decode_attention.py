"""Attention for one decode token of a grouped-query model, reading the KV cache once.

Under ``torch.compile`` transformers' SDPA and eager attention repeat a GQA model's key/value heads
to the number of query heads (``repeat_kv``) before attending: with a static cache every decode
step writes and then reads ``num_key_value_groups`` copies of the whole cache. On one H200 (Llama
3.2-1B shape, batch 64, a 192-token static cache) that was 1.3 ms of a 2.7 ms compiled step.
This function is transformers' eager attention (matmul, float32 softmax, matmul) with the query
heads grouped under their key/value head instead, so the cache is read once and nothing is
copied. Its numerics are eager's (scores in the model's dtype, softmax in float32), also for
SDPA models, whose SDPA kernels keep scores in float32: in bf16 the two differ within bf16
tolerance (the GPU test's teacher-forced logits), in float32 they agree (CPU tests).
hf_zero3's static loop uses it for its decode steps only (one query token), on models that take
their attention from transformers' attention interface; the prompt's forward and every other
shape keep the model's own attention (SDPA for any other shape).
"""

from __future__ import annotations

import contextlib

import torch

from .._upstream import transformers as hf_up

__all__ = ["NAME", "attention", "applies", "use"]

NAME = "hf_zero3_gqa_decode"
_REPLACES = ("sdpa", "eager")  # implementations whose decode step this computes the same way
_REGISTERED = False


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """``query`` (batch, heads, 1, dim), ``key``/``value`` (batch, kv_heads, length, dim); returns
    (batch, 1, heads, dim) as transformers' attention functions do, and no weights."""
    b, h, q, d = query.shape
    kv = key.shape[1]
    if q != 1 or kv == h or h % kv or dropout or kwargs.get("softcap") is not None:
        return hf_up.sdpa_attention()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scores = torch.matmul(query.reshape(b, kv, h // kv, d), key.transpose(2, 3))  # (b, kv, groups, length)
    scores = scores * (scaling if scaling is not None else d ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]  # (b, 1, 1, length): every head's the same
        if mask.shape[1] != 1:
            mask = mask.reshape(b, kv, h // kv, -1)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).reshape(b, 1, h, value.shape[-1]), None


def applies(model) -> bool:
    """A GQA model that looks its attention up by name, with SDPA or eager attention, one config,
    and plain softmax attention: no logit soft-capping (Gemma 2/3) and no attention sinks
    (gpt-oss), which transformers' own functions compute and this one does not."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(model, "_supports_attention_backend", False) or getattr(cfg, "sub_configs", None):
        return False
    if getattr(cfg, "attn_logit_softcapping", None) is not None or any(hasattr(m, "sinks") for m in model.modules()):
        return False
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    return (getattr(cfg, "_attn_implementation", None) in _REPLACES and isinstance(heads, int)
            and isinstance(kv, int) and kv < heads)


@contextlib.contextmanager
def use(model, on: bool = True):
    """Inside: ``model`` attends with :func:`attention` (when ``on`` and :func:`applies`)."""
    global _REGISTERED
    if not on:
        yield
        return
    if not _REGISTERED:
        hf_up.register_attention(NAME, attention)
        _REGISTERED = True
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before
