"""Phi-3 / Phi-4: its own ``prepare_inputs_for_generation``, which differs from GenerationMixin's
only once a sequence passes ``config.original_max_position_embeddings`` (there it drops the cache,
to recompute it with the long rotary factors): calls up to that length take the loop. Its MLP and
attention (fused gate/up and q/k/v projections) run the model's own code."""

from .family import Family

_M = "transformers.models.phi3.modeling_phi3."

FAMILY = Family(
    "phi3",
    generation_inputs=_M + "Phi3ForCausalLM.prepare_inputs_for_generation",
    inputs_limit="original_max_position_embeddings",
)
