"""Mistral: the MLP and the RMSNorm (its attention has a sliding window: the model's own)."""

from .family import Family

_M = "transformers.models.mistral.modeling_mistral."

FAMILY = Family(
    "mistral",
    mlp=(_M + "MistralMLP.forward",),
    norm=(_M + "MistralRMSNorm.forward",),
)
