"""Sliding-window layers that slide, on the static loop: a ring buffer of the window's size.

transformers' ``StaticSlidingWindowLayer`` keeps its fill count as a Python int and, once full,
rolls the whole window left by one every token: a step replayed from a CUDA graph would not
advance the int, and a compiled step would compile once per value. :class:`RingLayer` keeps the
same tokens (the last ``window`` of the call) in a ring: token ``c`` of the call lives in slot
``c % window``, written at a tensor index, so a decode step is one fixed sequence of kernels.

The slots are then not in token order, which transformers' mask functions (an offset and a
length per layer) cannot describe. So the loop builds each decode step's masks itself
(:func:`step_masks`): slot ``s`` holds token ``c_s = t - ((t - s) mod window)`` for the query at
cache index ``t``, and is attended where ``c_s >= 0`` and the prompt's padding mask keeps
``c_s``; every slot is inside the window by construction. A model with one kind of attention
layer takes that mask as a prepared 4-D mask, a hybrid (full and sliding layers: Gemma 2/3/4,
gpt-oss, Qwen2/3 with ``max_window_layers``) as a mapping from layer type to mask, which
transformers' decoders of those families accept (``_upstream.transformers.mask_mapping_accepted``).
The prompt's forward is the model's own: a prompt longer than the window attends over all its
tokens under the model's window mask, and the ring keeps the last ``window`` of them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

from .._upstream import transformers as hf_up

#: The layer types whose masks :func:`step_masks` builds (``config.layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: transformers' window semantics the ring keeps (``kv_idx > q_idx - sliding_window``: the last
#: ``sliding_window`` tokens, the query's own among them), checked by its source.
WINDOW_SOURCE = "transformers.masking_utils.sliding_window_overlay"
#: The attention implementations whose mask format :func:`step_masks` knows: a boolean mask (True
#: attends) for SDPA and hf_zero3's decode attention, an additive one for eager.
ADDITIVE = ("eager",)


class RingLayer(StaticLayer):
    """A sliding-window cache layer as a ring of ``window`` slots; ``span``: the longest call the
    cache was made for (the loop's buffers are that long)."""

    is_sliding = True

    def __init__(self, window: int, span: int):
        super().__init__(max_cache_len=window)
        self.window, self.span = window, span
        self.prefilled = False  # a Python flag: the prompt's forward ran (decode steps guard on it)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, w = key_states.shape[-2], self.window
        if self.prefilled:  # a decode step: token t into slot t % window
            slot = torch.remainder(self.cumulative_length, w).view(1)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            self.cumulative_length.add_(n)
            return self.keys, self.values
        self.prefilled = True
        self.cumulative_length.add_(n)
        if n <= w:  # the prompt fits: slots 0..n-1, as a static layer writes them
            index = torch.arange(n, device=self.keys.device)
            self.keys.index_copy_(2, index, key_states)
            self.values.index_copy_(2, index, value_states)
            return self.keys, self.values
        # a prompt longer than the window attends over all of itself (get_mask_sizes: (n, 0)); the
        # ring keeps its last `window` tokens, token c in slot c % window
        shift = n % w
        self.keys.copy_(torch.roll(key_states[:, :, -w:], shifts=shift, dims=2))
        self.values.copy_(torch.roll(value_states[:, :, -w:], shifts=shift, dims=2))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the prompt's forward only: decode steps get their masks from step_masks
        return max(self.window, query_length), 0

    def reset(self) -> None:
        super().reset()
        self.prefilled = False


def rings(cache) -> list[RingLayer]:
    return [layer for layer in getattr(cache, "layers", None) or () if type(layer) is RingLayer]


def why_not(model, cache) -> str | None:
    """Why ``cache``'s sliding layers cannot become rings for ``model`` (None: they can)."""
    cfg = model.config
    kinds = tuple(getattr(cfg, "layer_types", None) or ())
    other = sorted(set(kinds) - set(LAYER_TYPES))
    if other:
        return f"its layer types {other} are not full or sliding attention"
    unchecked = hf_up.unchecked_reason(WINDOW_SOURCE)
    if unchecked is not None:
        return unchecked
    impl = hf_up.attention_implementation(cfg)
    if impl not in ("sdpa", *ADDITIVE):
        return f"its attention implementation {impl!r} takes no prepared mask hf_zero3 builds (sdpa or eager do)"
    windows = set(hf_up.sliding_layer_lengths(cache))
    if len(windows) > 1:
        return f"its sliding layers have windows of different sizes {sorted(windows)}"
    full = [layer for layer in cache.layers if type(layer) is StaticLayer]
    if full and not hf_up.mask_mapping_accepted(model):
        return f"{type(model).__name__} builds one mask for all its layers, and its cache mixes full and sliding layers"
    return None


def make_rings(model, cache, length: int, span: int = 0) -> str | None:
    """Each sliding-window layer of ``cache`` that a call of ``length`` tokens would slide (and has
    not been used yet) becomes a :class:`RingLayer` of its window, for calls up to ``span`` tokens
    (at least ``length``: the cache's bucketed length, so that calls of one bucket share a loop);
    returns why they cannot (None: converted, or none to convert)."""
    windows = hf_up.sliding_layer_lengths(cache)
    if not windows:
        return None
    why = why_not(model, cache)
    if why is not None:
        return why
    layers = cache.layers
    sliding = hf_up.sliding_layer_class()
    span = max(length, span, *(layer.max_cache_len for layer in layers))
    for i, layer in enumerate(layers):
        if type(layer) is sliding and not getattr(layer, "is_initialized", True):
            layers[i] = RingLayer(layer.max_cache_len, span)
    for i, layer in enumerate(layers):
        if type(layer) is StaticLayer and layer.max_cache_len < span and not layer.is_initialized:
            layers[i] = StaticLayer(max_cache_len=span)  # every full layer as long as the loop's buffers
    return None


def step_masks(model, cache, padding: torch.Tensor):
    """A decode step's prepared masks over ``cache``, from the loop's 2-D ``padding`` mask over the
    call's cache indices: a mapping from layer type to mask where the cache has full layers too,
    else the rings' mask. Tensor work only (captured with the step's CUDA graph)."""
    ring = rings(cache)
    first = ring[0]
    t = first.cumulative_length  # the query's cache index: the token this step writes
    w = first.window
    slots = torch.arange(w, device=padding.device)
    tokens = t - torch.remainder(t - slots, w)  # the cache index each slot holds
    keep = padding.index_select(1, tokens.clamp(min=0)).bool() & (tokens >= 0)
    sliding = _formatted(model, keep[:, None, None, :], first.keys.dtype)
    full = [layer for layer in cache.layers if type(layer) is StaticLayer]
    if not full:
        return sliding
    n = full[0].max_cache_len
    causal = torch.arange(n, device=padding.device) <= t
    whole = padding[:, :n].bool() & causal
    return {
        "full_attention": _formatted(model, whole[:, None, None, :], first.keys.dtype),
        "sliding_attention": sliding,
    }


def _formatted(model, mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask (True attends) in the form the model's attention takes: additive for eager."""
    if hf_up.attention_implementation(model.config) in ADDITIVE:
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device))
    return mask
