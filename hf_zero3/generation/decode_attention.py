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
shape keep the model's own attention (SDPA for any other shape). On CUDA with Triton the same
attention runs as one kernel per layer (:mod:`hf_zero3.kernels.gqa_decode`: ``KERNEL``, float32
scores as flash attention keeps them, the unfilled tail of the cache not read); elsewhere, or with
``HF_ZERO3_TRITON_ATTENTION=0``, or where the kernel has fewer programs than the GPU has SMs
(batch x key/value heads: it is slower there), as the PyTorch form above (``NAME``).
:func:`choice` picks one when a decode loop is built.
"""

from __future__ import annotations

import contextlib

import torch

from .._upstream import transformers as hf_up
from ..kernels import gqa_decode

__all__ = ["NAME", "KERNEL", "attention", "kernel_attention", "applies", "choice", "use"]

NAME = "hf_zero3_gqa_decode"
KERNEL = gqa_decode.NAME
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


def kernel_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """:func:`attention` as one Triton kernel where :func:`gqa_decode.supports` the shapes (the
    PyTorch form otherwise)."""
    if (dropout or kwargs.get("softcap") is not None or key.shape[1] == query.shape[1]
            or not gqa_decode.supports(query, key, value, attention_mask)):
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return gqa_decode.gqa_decode_attention(query, key, value, attention_mask, scale), None


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


def choice(model, device, rows: int) -> str | None:
    """The decode attention a loop of ``rows`` on ``device`` uses: ``KERNEL`` (CUDA, Triton, where
    it is the faster form: :func:`gqa_decode.pays`), ``NAME``, or None (the model's own:
    :func:`applies` is False)."""
    if not applies(model):
        return None
    if (torch.device(device).type == "cuda" and gqa_decode.is_available() and gqa_decode.load() is not None
            and gqa_decode.pays(rows, model.config.num_key_value_heads)):
        return KERNEL  # built here, outside the compiled step's trace
    return NAME


@contextlib.contextmanager
def use(model, name: str | None = NAME):
    """Inside: ``model`` attends with ``name`` (:func:`attention` or :func:`kernel_attention`;
    None: its own attention)."""
    global _REGISTERED
    if name is None:
        yield
        return
    if not _REGISTERED:
        hf_up.register_attention(NAME, attention)
        hf_up.register_attention(KERNEL, kernel_attention)
        _REGISTERED = True
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = before
