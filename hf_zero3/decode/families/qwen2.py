"""Qwen2: the MLP (its attention projections carry biases: the model's own attention forward)."""

from .family import Family

FAMILY = Family("qwen2", mlp=("transformers.models.qwen2.modeling_qwen2.Qwen2MLP.forward",))
