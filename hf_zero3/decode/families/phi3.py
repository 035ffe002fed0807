"""Phi-3 / Phi-4: its own ``prepare_inputs_for_generation``, which differs from GenerationMixin's
only once a sequence passes ``config.original_max_position_embeddings`` (there it drops the cache,
to recompute it with the long rotary factors): calls up to that length take the loop. Its MLP's
fused ``gate_up_proj`` runs as the gate/up kernel over the weight's two row halves; its attention
(fused q/k/v, one query head per key/value head) runs the model's own code around the decode
attention kernel. Its RMSNorm is Llama's."""

from .family import Family

_M = "transformers.models.phi3.modeling_phi3."

FAMILY = Family(
    "phi3",
    fused_mlp=(_M + "Phi3MLP.forward",),
    norm=(_M + "Phi3RMSNorm.forward",),
    generation_inputs=_M + "Phi3ForCausalLM.prepare_inputs_for_generation",
    inputs_limit="original_max_position_embeddings",
)
