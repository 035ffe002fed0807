"""Qwen2: the MLP, the RMSNorm and the rotary embedding (its attention projections carry biases: the model's own
attention forward)."""

from .family import Family

_M = "transformers.models.qwen2.modeling_qwen2."

FAMILY = Family(
    "qwen2",
    mlp=(_M + "Qwen2MLP.forward",),
    norm=(_M + "Qwen2RMSNorm.forward",),
    rotary=(_M + "apply_rotary_pos_emb", _M + "rotate_half"),
)
