"""The ring layer a sliding window slides in (:mod:`hf_zero3.decode.ring_cache`): where it keeps each
token, the masks a decode step gets, and the cases it refuses with a reason (then transformers'
loop decodes the call, as eligibility says)."""

import pytest
import torch
from transformers.cache_utils import StaticCache

from hf_zero3._upstream import transformers as hf_up
from hf_zero3.decode import ring_cache
from hf_zero3.testing import models


def _kv(n: int, start: int = 0) -> torch.Tensor:
    """(1, 1, n, 1) keys whose value is their token index."""
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)


def test_a_prompt_longer_than_the_window_keeps_its_last_tokens_each_in_slot_index_mod_window():
    layer = ring_cache.RingLayer(window=4, span=32)
    assert layer.get_mask_sizes(7) == (7, 0)  # the prompt attends over all of itself, under the model's window mask
    keys, _ = layer.update(_kv(7), _kv(7))
    assert keys.shape[-2] == 7
    assert layer.keys.flatten().tolist() == [4.0, 5.0, 6.0, 3.0]  # token c in slot c % 4
    for t in (7, 8, 9):  # decode steps write token t into slot t % 4
        keys, _ = layer.update(_kv(1, t), _kv(1, t))
        assert keys.shape[-2] == 4 and keys.flatten()[t % 4] == t
    assert layer.keys.flatten().tolist() == [8.0, 9.0, 6.0, 7.0] and int(layer.cumulative_length) == 10


def test_a_prompt_shorter_than_the_window_fills_the_first_slots():
    layer = ring_cache.RingLayer(window=6, span=32)
    assert layer.get_mask_sizes(3) == (6, 0)
    keys, _ = layer.update(_kv(3), _kv(3))
    assert keys.shape[-2] == 6 and layer.keys.flatten().tolist() == [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]
    layer.reset()
    assert not layer.prefilled and int(layer.cumulative_length) == 0


def test_the_step_masks_keep_each_slots_token_where_the_padding_does():
    """Slot s holds token t - ((t - s) mod w); it is attended where that token exists and is not
    padding. Full layers get causal + padding over the whole cache."""
    model = models.plain_model(models.tiny_gemma3_config(sliding_window=4, attn_implementation="sdpa"))
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert ring_cache.make_rings(model, cache, 16) is None
    assert len(ring_cache.rings(cache)) == 5
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, :6] = 0  # row 0: six tokens of left padding
    for layer in ring_cache.rings(cache):
        layer.cumulative_length.fill_(7)  # the step writes token 7: slots 0..3 hold tokens 4..7
    masks = ring_cache.step_masks(model, cache, padding)
    sliding, full = masks["sliding_attention"], masks["full_attention"]
    assert sliding.shape == (2, 1, 1, 4) and full.shape == (2, 1, 1, 16)
    assert sliding[0, 0, 0].tolist() == [False, False, True, True]  # tokens 4 and 5 are padding
    assert sliding[1, 0, 0].tolist() == [True, True, True, True]
    assert full[1, 0, 0].tolist() == [True] * 8 + [False] * 8  # causal: tokens 0..7
    for layer in ring_cache.rings(cache):
        layer.cumulative_length.fill_(2)  # before the ring is full: slot 3 holds no token yet
    assert ring_cache.step_masks(model, cache, padding)["sliding_attention"][1, 0, 0].tolist() == [
        True,
        True,
        True,
        False,
    ]


def test_eager_attention_gets_an_additive_mask():
    model = models.plain_model(models.tiny_mistral_config(sliding_window=4))  # eager: tiny configs' default
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert ring_cache.make_rings(model, cache, 16) is None
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
        layer.cumulative_length.fill_(2)
    mask = ring_cache.step_masks(model, cache, torch.ones(1, 16, dtype=torch.long))
    assert torch.is_tensor(mask) and mask.dtype == torch.float32  # one kind of layer: one 4-D mask
    assert mask[0, 0, 0, :3].tolist() == [0.0, 0.0, 0.0] and mask[0, 0, 0, 3] == torch.finfo(torch.float32).min


def _gemma(**kw):
    return models.plain_model(models.tiny_gemma3_config(sliding_window=4, **kw))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("flex", "attention implementation 'flex_attention'"),
        ("one_mask", "builds one mask for all its layers"),
        ("chunked", "are not full or sliding attention"),
        ("changed_window", "sliding_window_overlay is not the code hf_zero3 was checked against"),
    ],
)
def test_a_model_whose_masks_the_ring_cannot_build_keeps_its_sliding_layers_and_says_why(case, expected, monkeypatch):
    model = _gemma()
    if case == "flex":
        model.config._attn_implementation = "flex_attention"
    if case == "one_mask":
        monkeypatch.setattr(hf_up, "mask_mapping_accepted", lambda m: False)
    if case == "chunked":
        model.config.layer_types = ["chunked_attention"] + model.config.layer_types[1:]
    if case == "changed_window":
        from transformers import masking_utils

        def overlay(sliding_window):  # a release that keeps one token fewer
            def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
                return kv_idx > q_idx - sliding_window + 1

            return inner_mask

        monkeypatch.setattr(masking_utils, "sliding_window_overlay", overlay)
        hf_up._FINGERPRINTS.clear()
    cache = StaticCache(config=_gemma().config, max_cache_len=16)
    why = ring_cache.make_rings(model, cache, 16)
    assert expected in why, why
    assert not ring_cache.rings(cache) and hf_up.sliding_layer_lengths(cache) == [4] * 5
