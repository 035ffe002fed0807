"""What one model family's fast decode path replaces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """The transformers functions (dotted paths) a family's decode steps compute themselves."""

    model_type: str
    mlp: tuple[str, ...] = ()  # MLP forwards computed as down(silu(gate(x)) * up(x))
    # MLP forwards computed as down(up * silu(gate)), (gate, up) the two halves of gate_up_proj(x)
    fused_mlp: tuple[str, ...] = ()
    rope_attention: tuple[str, ...] = ()  # attention forward + the rotary helpers it calls
    norm: tuple[str, ...] = ()  # RMSNorm forwards computed as Llama's (an eager step's norm kernel)
    # the module-level apply_rotary_pos_emb and the rotate_half it calls (an eager step's rotary kernel)
    rotary: tuple[str, ...] = ()
    # the family's own prepare_inputs_for_generation, read and found to be GenerationMixin's for
    # calls up to ``config.<inputs_limit>`` tokens (None: no limit)
    generation_inputs: str | None = None
    inputs_limit: str | None = None
