"""Whether a call can take the static loop: it runs only where it is exact (see
:mod:`.static_loop`); anything else decodes through transformers, with the reason :func:`unsupported`
gives in ``hf_zero3_last_generate.loop_reason``."""

from __future__ import annotations

from transformers.cache_utils import StaticLayer
from transformers.generation.utils import GenerationMixin

from .._upstream import transformers as hf_up
from . import families, logits_processors, ring_cache
from .caches import FORWARD_FAILED

# Criteria the loop computes itself: the step budget, and EOS on the token just chosen.
GRAPH_SAFE_CRITERIA = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})
_MODEL_KWARGS = frozenset(
    {
        "attention_mask",
        *hf_up.CACHE_KEYWORDS,
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "logits_to_keep",
        "cache_position",
        "position_ids",
    }
)


def _static_layers(cache) -> bool:
    """Every layer is one the loop steps in place: a static layer, a ring (:mod:`.ring_cache`), or a
    linear-attention layer's static states (not recording its past for a rollback)."""
    linear = hf_up.linear_attention_layer_class()
    layers = getattr(cache, "layers", None)
    return (
        bool(layers)
        and all(
            type(layer) in (StaticLayer, ring_cache.RingLayer)
            or (linear is not None and type(layer) is linear and not layer.record_past)
            for layer in layers
        )
        and any(hasattr(layer, "max_cache_len") for layer in layers)
    )


def unsupported(
    model, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs, length: int
) -> str | None:
    """Why this call cannot take the loop (None: it can); ``length``: prompt + the agreed step
    budget. Local: ranks that decide differently still agree at the same steps."""
    if model in FORWARD_FAILED:
        return FORWARD_FAILED[model]
    if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        why = families.generation_inputs_reason(model, length)
        if why is not None:
            return why
    if streamer is not None:
        return "a streamer was passed"
    if generation_config.return_dict_in_generate:
        asked = [k for k in _PER_STEP_OUTPUTS if getattr(generation_config, k, False)]
        if asked:  # the sequences alone (TRL's GKD and GOLD ask so) come back in transformers' output class
            return f"return_dict_in_generate with {', '.join(asked)} (per-step outputs)"
    if getattr(generation_config, "is_assistant", False):
        return "assisted decoding"
    for p in logits_processor or ():
        why = logits_processors.unsupported(p)
        if why is not None:
            return why
    for c in stopping_criteria or ():
        if type(c).__name__ not in GRAPH_SAFE_CRITERIA:
            return f"stopping criterion {type(c).__name__} is not one the loop computes"
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if extra:
        return f"model inputs {extra} are not static"
    positions = model_kwargs.get("position_ids")
    if positions is not None and positions.dim() != 2:
        return "position_ids are not 2-D (one position per token)"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return "attention_mask is not a 2-D padding mask"
    cache = hf_up.generation_cache(model_kwargs)
    windows = hf_up.sliding_layer_lengths(cache)
    if windows:  # ring_cache.make_rings left them: why_not says why
        return (
            f"a sliding-window cache layer holds {min(windows)} tokens, fewer than prompt + new tokens "
            f"({length}), and cannot slide as a ring: {ring_cache.why_not(model, cache)}"
        )
    if cache is None or not _static_layers(cache):
        return "the cache is not transformers' StaticCache (StaticLayer layers)"
    room = cache_length(cache)
    if length > room:
        return f"the static cache holds {room} tokens, fewer than prompt + new tokens ({length})"
    return None


#: Generation options that ask transformers' loop for per-step tensors the static loop does not keep.
_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def cache_length(cache) -> int:
    """Tokens of a call every layer of a static cache holds (a ring: every call up to its span; a
    linear-attention layer: any)."""
    return min(
        layer.span if type(layer) is ring_cache.RingLayer else layer.max_cache_len
        for layer in cache.layers
        if hasattr(layer, "max_cache_len")
    )


def failure(model) -> str | None:
    """Why ``model``'s forward did not compile into one graph (None: it did, or was not tried)."""
    return FORWARD_FAILED.get(model)
