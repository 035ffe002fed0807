"""Qwen3: the MLP (its attention normalizes q and k per head: the model's own attention forward)."""

from .family import Family

FAMILY = Family("qwen3", mlp=("transformers.models.qwen3.modeling_qwen3.Qwen3MLP.forward",))
