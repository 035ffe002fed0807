"""Mistral: the MLP, the RMSNorm and the rotary embedding (its attention has a sliding window: the model's own)."""

from .family import Family

_M = "transformers.models.mistral.modeling_mistral."

FAMILY = Family(
    "mistral",
    mlp=(_M + "MistralMLP.forward",),
    norm=(_M + "MistralRMSNorm.forward",),
    rotary=(_M + "apply_rotary_pos_emb", _M + "rotate_half"),
)
