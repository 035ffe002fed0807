"""Tiny Hugging Face models built in code (nothing downloaded), partitioned like real ones.

``zero3_model`` builds the model under ``HfDeepSpeedConfig`` so transformers wraps ``__init__``
in ``deepspeed.zero.Init``: each parameter is partitioned the moment it is created, exactly as
``from_pretrained`` does for an 8B model. ``unsharded_copy`` gathers those weights into a plain
model that serves as the single-process reference in tests.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# transformers forgets an HfDeepSpeedConfig that nothing references; keep ours alive.
_LIVE_DS_CONFIGS: list[Any] = []


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_t5_config(**overrides):
    from transformers import T5Config

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


def model_class_for(config):
    """The generation model class for a tiny config (imported before any ``zero.Init``)."""
    import transformers

    name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "t5": "T5ForConditionalGeneration"}[
        config.model_type
    ]
    return getattr(transformers, name)


def zero3_model(config, ds_config: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Build ``config``'s model with ZeRO-3 partitioning applied at construction."""
    from transformers.integrations import HfDeepSpeedConfig

    cls = model_class_for(config)  # import model classes before zero.Init wraps __init__
    ensure_deepspeed_comm()
    _LIVE_DS_CONFIGS.append(HfDeepSpeedConfig(ds_config))
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def ensure_deepspeed_comm() -> None:
    """DeepSpeed reads the world size from its own comm layer; wrap an existing torch group."""
    import deepspeed
    import torch.distributed as dist

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
    import deepspeed

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
    from hf_zero3._upstream.transformers import hf_deepspeed_config_ref, set_hf_deepspeed_config_ref

    saved = hf_deepspeed_config_ref()
    set_hf_deepspeed_config_ref(None)
    try:
        yield
    finally:
        set_hf_deepspeed_config_ref(saved)
