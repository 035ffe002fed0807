"""Qwen3: the MLP, the RMSNorm and the rotary embedding (its attention normalizes q and k per head: the model's own
attention forward, whose per-head norms take the norm kernel where their rows are contiguous)."""

from .family import Family

_M = "transformers.models.qwen3.modeling_qwen3."

FAMILY = Family(
    "qwen3",
    mlp=(_M + "Qwen3MLP.forward",),
    norm=(_M + "Qwen3RMSNorm.forward",),
    rotary=(_M + "apply_rotary_pos_emb", _M + "rotate_half"),
)
