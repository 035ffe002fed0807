"""Models built in code (nothing downloaded), partitioned like real ones, and a tokenizer to match.

The configs are tiny ones for CPU tests and real models' sizes (random weights) for GPU tests and
benchmarks; each takes keyword overrides of its fields. ``zero3_model`` builds a model under
``HfDeepSpeedConfig`` so transformers wraps ``__init__`` in ``deepspeed.zero.Init``: each parameter
is partitioned the moment it is created, exactly as ``from_pretrained`` does for an 8B model.
``unsharded_copy`` gathers those weights into a plain model that serves as the single-process
reference in tests.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import PreTrainedTokenizerFast, T5Config
from transformers.integrations import HfDeepSpeedConfig

from .._upstream.transformers import causal_lm_class, hf_deepspeed_config_ref, set_hf_deepspeed_config_ref

# transformers forgets an HfDeepSpeedConfig that nothing references; keep ours alive.
_LIVE_DS_CONFIGS: list[Any] = []


def _shape(vocab, hidden, intermediate, layers, heads, kv_heads, positions, **rest) -> dict:
    """A decoder's sizes, with the ids every decoder config here uses: pad 0, bos 1, eos 2."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **rest,
    )


#        vocab,  hidden, intermediate, layers, heads, kv heads, positions
_TINY = _shape(96, 32, 64, 2, 4, 2, 256, attn_implementation="eager")
_SMALL = _shape(32000, 1024, 2816, 4, 16, 8, 1024, attn_implementation="sdpa")
_LLAMA_1B = _shape(128256, 2048, 8192, 16, 32, 8, 2048, tie_word_embeddings=True, attn_implementation="sdpa")
_LLAMA_8B = _shape(128256, 4096, 14336, 32, 32, 8, 2048, rope_theta=5e5, attn_implementation="sdpa")
_QWEN2_0_5B = _shape(
    151936, 896, 4864, 24, 14, 2, 32768, rope_theta=1e6, tie_word_embeddings=True, attn_implementation="sdpa"
)


def _config(cls_name: str, shape: dict, overrides: dict):
    return getattr(transformers, cls_name)(**{**shape, **overrides})


def tiny_llama_config(**overrides):
    """A 2-layer Llama, hidden 32, GQA 4/2 heads, vocab 96, eager attention: the CPU tests' model."""
    return _config("LlamaConfig", {**_TINY, "tie_word_embeddings": False}, overrides)


def tiny_qwen2_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Qwen2 (q/k/v biases, tied embeddings)."""
    return _config("Qwen2Config", {**_TINY, "tie_word_embeddings": True}, overrides)


def tiny_mistral_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Mistral, with Mistral's default sliding window (4096)."""
    return _config("MistralConfig", {**_TINY, "tie_word_embeddings": False}, overrides)


def tiny_qwen3_moe_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Qwen3-MoE: 8 experts of width 16, top-2, every layer sparse."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, head_dim=8)
    return _config("Qwen3MoeConfig", {**_TINY, **moe}, overrides)


def tiny_mixtral_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Mixtral: 4 experts, top-2."""
    return _config("MixtralConfig", {**_TINY, "num_local_experts": 4, "num_experts_per_tok": 2}, overrides)


def tiny_gpt_oss_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a gpt-oss: 4 experts (top-2, biased, clamped SwiGLU),
    attention sinks, one sliding layer (window 8) and one full layer."""
    extra = dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    return _config("GptOssConfig", {**_TINY, **extra}, overrides)


def tiny_phi3_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Phi-3 (fused gate/up and q/k/v projections, its own
    ``prepare_inputs_for_generation``; ``original_max_position_embeddings`` 4096 as Phi-3-mini's)."""
    return _config("Phi3Config", {**_TINY, "original_max_position_embeddings": 4096}, overrides)


def tiny_gemma3_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Gemma 3 text model (head dim 8): five sliding layers to
    one full, as Gemma 3's pattern, over 6 layers, a window of 4."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    shape = {**_TINY, "num_hidden_layers": 6, "head_dim": 8, "sliding_window": 4, "layer_types": kinds}
    return _config("Gemma3TextConfig", shape, overrides)


def tiny_qwen3_5_config(**overrides):
    """:func:`tiny_llama_config`'s sizes as a Qwen3.5 text model: three linear-attention (gated
    delta rule) layers to one full-attention layer, over 4 layers."""
    linear = dict(
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_hidden_layers=4,
    )
    return _config("Qwen3_5TextConfig", {**_TINY, **linear}, overrides)


def small_llama_config(**overrides):
    """A 4-layer Llama, hidden 1024, GQA 16/8 heads, vocab 32000, SDPA (112M parameters): large
    enough for GPU kernels and DeepCompile to behave as on a real model, quick to build."""
    return _config("LlamaConfig", _SMALL, overrides)


def small_mistral_config(**overrides):
    """:func:`small_llama_config`'s sizes as a Mistral, with Mistral's default sliding window (4096)."""
    return _config("MistralConfig", _SMALL, overrides)


def small_qwen2_config(**overrides):
    """:func:`small_llama_config`'s sizes as a Qwen2."""
    return _config("Qwen2Config", _SMALL, overrides)


def llama_1b_shape_config(**overrides):
    """Llama-3.2-1B's sizes (hidden 2048, intermediate 8192, 16 layers, GQA 32/8, vocab 128256,
    tied embeddings), SDPA; random weights once built."""
    return _config("LlamaConfig", _LLAMA_1B, overrides)


def llama_8b_shape_config(**overrides):
    """Llama-3-8B's sizes (hidden 4096, intermediate 14336, 32 layers, GQA 32/8, vocab 128256,
    untied embeddings), SDPA; random weights once built."""
    return _config("LlamaConfig", _LLAMA_8B, overrides)


def qwen2_0_5b_shape_config(**overrides):
    """Qwen2.5-0.5B's sizes and RoPE (hidden 896, intermediate 4864, 24 layers, GQA 14/2, vocab
    151936, tied embeddings, 494M parameters), SDPA; pad/bos/eos are :func:`tiny_tokenizer`'s."""
    return _config("Qwen2Config", _QWEN2_0_5B, overrides)


def qwen3_moe_shape_config(**overrides):
    """Qwen3-30B-A3B's sizes (hidden 2048, 128 experts of width 768, top-8, GQA 32/4, head dim 128,
    vocab 151936, 48 layers: pass ``num_hidden_layers`` for a size that fits), SDPA."""
    moe = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, head_dim=128, rope_theta=1e6)
    return _config(
        "Qwen3MoeConfig",
        {**_shape(151936, 2048, 6144, 48, 32, 4, 40960, **moe), "attn_implementation": "sdpa"},
        overrides,
    )


def gemma3_1b_shape_config(**overrides):
    """Gemma-3-1B's sizes (hidden 1152, intermediate 6912, 26 layers of five sliding (window 512) to
    one full, 4 query heads to 1 key/value head of dim 256, vocab 262144, tied embeddings), SDPA."""
    kinds = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)]
    extra = dict(
        head_dim=256, sliding_window=512, layer_types=kinds, query_pre_attn_scalar=256, tie_word_embeddings=True
    )
    return _config(
        "Gemma3TextConfig",
        {**_shape(262144, 1152, 6912, 26, 4, 1, 32768, **extra), "attn_implementation": "sdpa"},
        overrides,
    )


def phi3_mini_shape_config(**overrides):
    """Phi-3-mini's sizes (hidden 3072, intermediate 8192, 32 layers, 32 heads of 96, no GQA, vocab
    32064, ``original_max_position_embeddings`` 4096), SDPA."""
    extra = dict(original_max_position_embeddings=4096, attn_implementation="sdpa")
    return _config("Phi3Config", _shape(32064, 3072, 8192, 32, 32, 32, 4096, **extra), overrides)


def qwen3_5_shape_config(**overrides):
    """A Qwen3.5-shaped hybrid (transformers' ``Qwen3_5TextConfig`` defaults: hidden 4096,
    intermediate 12288, three gated-delta-rule layers to one full-attention layer, GQA 16/4 of dim
    256, vocab 248320; 32 layers: pass ``num_hidden_layers``, a multiple of 4, for a size that fits), SDPA."""
    layers = overrides.pop("num_hidden_layers", 32)
    kinds = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    extra = dict(head_dim=256, layer_types=kinds, attn_implementation="sdpa")
    return _config("Qwen3_5TextConfig", _shape(248320, 4096, 12288, layers, 16, 4, 32768, **extra), overrides)


def tiny_t5_config(**overrides):
    """A T5 with 2 encoder and 2 decoder layers, d_model 32, 4 heads, vocab 96: the tests' encoder-decoder."""
    kw = dict(
        vocab_size=96,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        relative_attention_num_buckets=8,
    )
    kw.update(overrides)
    return T5Config(**kw)


_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos
_MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def tiny_tokenizer():
    """A byte-level BPE tokenizer (no merges: 256 bytes plus chat tokens) with Qwen2.5's chat
    template, for TRL trainers built on a tiny Qwen2.

    ``pad``/``bos``/``eos`` are ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` with ids 0/1/2,
    as in the decoder configs here; ``len(tokenizer)`` is the vocab size a model needs. The chat template is
    TRL's stored Qwen2.5 template verbatim, which TRL recognises: it adds the Qwen response parser
    for tool calls and finds the template prefix-preserving. The tool-call markup tokens are plain
    added tokens, as in Qwen2.5's vocabulary.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers  # optional: tokenizers
    from tokenizers.models import BPE  # optional: tokenizers
    from trl.chat_template_utils import qwen2_5_chat_template  # optional: trl

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(_SPECIAL + _MARKUP + alphabet)}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(_SPECIAL)
    backend.add_tokens(_MARKUP)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=_SPECIAL[0],
        bos_token=_SPECIAL[1],
        eos_token=_SPECIAL[2],
        chat_template=qwen2_5_chat_template,
    )


def model_class_for(config):
    """The generation model class for a tiny config (imported before any ``zero.Init``)."""
    if config.model_type == "t5":
        return transformers.T5ForConditionalGeneration
    return causal_lm_class(config)


def zero3_model(config, ds_config: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Build ``config``'s model with ZeRO-3 partitioning applied at construction."""
    cls = model_class_for(config)  # import model classes before zero.Init wraps __init__
    ensure_deepspeed_comm()
    _LIVE_DS_CONFIGS.append(HfDeepSpeedConfig(ds_config))
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def ensure_deepspeed_comm() -> None:
    """DeepSpeed reads the world size from its own comm layer; wrap an existing torch group."""
    import deepspeed  # not at import: hf_zero3.testing loads before run_ranks sets a rank's DS_ACCELERATOR

    if dist.is_initialized() and not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)


def plain_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The same model with no DeepSpeed at all."""
    cls = model_class_for(config)
    torch.manual_seed(seed)
    with _without_hf_deepspeed_config():
        model = cls._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def unsharded_copy(model):
    """A plain (non-ZeRO) copy of a ZeRO-3 model's current weights, for reference outputs.

    Collective: every rank of the model's group must call it.
    """
    import deepspeed  # not at import: hf_zero3.testing loads before run_ranks sets a rank's DS_ACCELERATOR

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cls = type(model)
    for base in cls.__mro__:  # a lockstep subclass: rebuild the library class
        if base.__module__.startswith("transformers."):
            cls = base
            break
    with _without_hf_deepspeed_config():
        copy = cls._from_config(model.config)
    copy.load_state_dict(state)
    if hasattr(model, "generation_config"):
        copy.generation_config = model.generation_config
    return copy.eval()


@contextlib.contextmanager
def _without_hf_deepspeed_config():
    """Build a plain model while a ZeRO-3 ``HfDeepSpeedConfig`` is live in this process."""
    saved = hf_deepspeed_config_ref()
    set_hf_deepspeed_config_ref(None)
    try:
        yield
    finally:
        set_hf_deepspeed_config_ref(saved)
