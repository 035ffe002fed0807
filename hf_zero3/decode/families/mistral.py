"""Mistral: the MLP (its attention has a sliding window: the model's own)."""

from .family import Family

FAMILY = Family("mistral", mlp=("transformers.models.mistral.modeling_mistral.MistralMLP.forward",))
