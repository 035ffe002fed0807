"""Llama: the MLP, the attention forward with its rotary embedding (the rope kernel), the RMSNorm, the
rotary embedding of an eager step."""

from .family import Family

_M = "transformers.models.llama.modeling_llama."

FAMILY = Family(
    "llama",
    mlp=(_M + "LlamaMLP.forward",),
    rope_attention=(_M + "LlamaAttention.forward", _M + "apply_rotary_pos_emb", _M + "rotate_half"),
    norm=(_M + "LlamaRMSNorm.forward",),
    rotary=(_M + "apply_rotary_pos_emb", _M + "rotate_half"),
)
