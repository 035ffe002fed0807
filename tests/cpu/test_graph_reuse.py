"""When hf_zero3's static loop may replay what an earlier call captured: only with the same
parameters, buffers, model state, processors and every tensor of the static cache (a replayed CUDA
graph re-checks nothing). Real transformers model, StaticCache and processors; no GPU needed for
the keys (the CUDA-graph replay itself is tested in tests/gpu/test_compiled_decode_gpu.py)."""

from dataclasses import replace

import pytest
import torch

from hf_zero3._upstream import transformers as hf_up
from hf_zero3.decode import features
from hf_zero3.options import DecodeOptions

DEFAULTS = DecodeOptions().resolved({})  # the measured best, whatever the environment holds


def _part(loop, kind):
    """The loop's feature of class ``kind``."""
    return next(f for f in loop.features if isinstance(f, kind))


def _with(**changes) -> DecodeOptions:
    return replace(DEFAULTS, **changes)


@pytest.fixture()
def parts():
    from transformers import GenerationConfig
    from transformers.cache_utils import StaticCache

    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config()).eval()
    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    with torch.no_grad():
        model(input_ids=ids, **hf_up.cache_arguments(cache), use_cache=True)  # allocates the cache's tensors
    return model, cache, ids, GenerationConfig(do_sample=False)


def test_graphs_are_kept_only_while_the_cache_tensors_are_those_captured(parts):
    from hf_zero3.decode.loop import DecodeLoop

    model, cache, ids, _ = parts
    loop = DecodeLoop(2, 16, ids.device, None, False)
    loop.cache = cache
    loop.bind_cache()
    loop.graphs[1] = "captured"
    loop.bind_cache()  # the same tensors: kept
    assert loop.graphs == {1: "captured"}
    # transformers 5.17 builds a new cache each call: its keys and values usually land where the
    # last ones were, its length counters need not; the loop hands the layer back the counter the
    # graphs read (with the new one's value) and keeps the graphs
    layer = cache.layers[0]
    captured = layer.cumulative_length
    layer.cumulative_length = torch.full_like(captured, 5)
    loop.bind_cache()
    assert loop.graphs == {1: "captured"}
    assert layer.cumulative_length is captured and int(captured) == 5
    # keys at another address (another cache, still alive): the graphs are dropped and a warm-up
    # step comes first, and its counter stays its own (two live caches never share one)
    loop.warm = True
    layer.keys = layer.keys.clone()
    own = torch.full_like(captured, 7)
    layer.cumulative_length = own
    loop.bind_cache()
    assert loop.graphs == {} and not loop.warm
    assert layer.cumulative_length is own and int(captured) == 5
    assert loop.moved == ("cache keys/values",)  # the report's graphs_moved: why this call captured anew
    loop.bind_cache()  # nothing was captured since: nothing to say moved
    assert loop.moved == ()
    loop.graphs[1] = "captured"
    loop.bind_cache()
    assert loop.moved == () and loop.graphs == {1: "captured"}


def test_the_key_follows_parameters_state_hooks_and_processors(parts):
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from hf_zero3.decode import gqa_attention
    from hf_zero3.decode import loop_cache as gd

    model, cache, ids, cfg = parts
    attention = gqa_attention.choice(model, ids.device, ids.shape[0])  # as loop_for passes it
    options = DecodeOptions().resolved({})
    procs = [TemperatureLogitsWarper(0.7)]
    key = gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)
    assert gd._loop_key(model, ids, [TemperatureLogitsWarper(0.7)], cfg, None, cache, attention, options) == key
    assert gd._loop_key(model, ids, [TemperatureLogitsWarper(0.9)], cfg, None, cache, attention, options)[0] != key[0]
    model.train()
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)[1] != key[1]
    model.eval()
    model.model.layers[0].self_attn.lora_scaling = {"default": 2.0}  # PEFT keeps per-adapter values in dicts
    scaled = gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)
    model.model.layers[0].self_attn.lora_scaling = {"default": 0.5}
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)[1] != scaled[1]
    del model.model.layers[0].self_attn.lora_scaling
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)[1] != key[1]
    handle.remove()
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options) == key
    # DeepSpeed's own module counters move with every training step and no forward reads them
    model.applied_pre_backward_ref_cnt = 3
    model.model.ds_grads_remaining = 1
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options) == key
    del model.applied_pre_backward_ref_cnt, model.model.ds_grads_remaining
    with torch.no_grad():
        w = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(w.clone())  # new storage, as a new gathered region gives
    assert gd._loop_key(model, ids, procs, cfg, None, cache, attention, options)[1] != key[1]

    class Holding(TemperatureLogitsWarper):  # a processor holding a tensor is never kept
        def __init__(self):
            super().__init__(0.7)
            self.bias = torch.zeros(3)

    assert gd._loop_key(model, ids, [Holding()], cfg, None, cache, attention, options) is None


def test_loops_are_kept_per_shape_replaced_when_stale_and_released(parts):
    from hf_zero3.decode import loop_cache as gd
    from hf_zero3.decode.caches import LOOPS
    from hf_zero3.generation import release_decode_graphs

    model, cache, ids, cfg = parts
    first, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, DEFAULTS)
    again, kept_again = gd.loop_for(model, ids, [], cfg, None, None, cache, DEFAULTS)
    assert not kept and kept_again and again is first
    model.train()  # a state the compiled forward guards on: a new loop replaces the stale one
    other, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, DEFAULTS)
    assert not kept and other is not first and len(LOOPS[model]) == 1
    model.eval()
    for batch in (3, 4, 5):  # other batch sizes: at most KEEP shapes per model
        gd.loop_for(model, ids[:1].expand(batch, -1), [], cfg, None, None, cache, DEFAULTS)
    assert len(LOOPS[model]) == gd.KEEP
    release_decode_graphs(model)
    assert model not in LOOPS


def test_a_4d_attention_mask_keeps_transformers_loop(parts):
    from hf_zero3.decode import eligibility as gd

    model, cache, ids, cfg = parts
    kwargs = {**hf_up.cache_arguments(cache), "attention_mask": torch.ones(2, 1, 3, 16, dtype=torch.bool)}
    assert "2-D padding mask" in gd.unsupported(model, [], [], cfg, None, kwargs, 8)
    kwargs["attention_mask"] = torch.ones(2, 3, dtype=torch.long)
    assert gd.unsupported(model, [], [], cfg, None, kwargs, 8) is None


def test_dependent_launches_fall_back_quietly_by_default_and_say_why_when_asked(parts, caplog):
    """Dependent launches (``dependent_launches="auto"``, the default) make the decode steps'
    kernels programmatic dependent launches where the GPU can; here (no Hopper GPU) the loop
    launches as usual: silently at the default, with one log line saying why when ``"on"`` asks for
    it. The options are part of what a kept loop is for (another value builds a new loop)."""
    from hf_zero3.decode import loop_cache as gd
    from hf_zero3.generation import release_decode_graphs
    from hf_zero3.kernels import decode_gemm

    model, cache, ids, cfg = parts
    why = decode_gemm.dependent_unavailable("cpu")
    assert why is not None and ("NVIDIA GPU" in why or "interpreter" in why or "Triton" in why), why
    features._PDL_REFUSED.clear()
    with caplog.at_level("WARNING", logger="hf_zero3.generation"):
        assert features.dependent_launches("cpu") is False
        default, _ = gd.loop_for(model, ids, [], cfg, None, None, cache, DEFAULTS)
        assert default.dependent is False
        assert not [r for r in caplog.records if "dependent launches" in r.getMessage()]
        assert features.dependent_launches("cpu", "on") is False and features.dependent_launches("cpu", "on") is False
    said = [r.getMessage() for r in caplog.records if "dependent launches" in r.getMessage()]
    assert len(said) == 1 and why in said[0], said
    assert _part(default, features.RopeAttention).qkv is None  # the q/k/v partials ride on dependent launches
    off, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, _with(dependent_launches="off"))
    assert not kept and off is not default and off.dependent is False
    qkv_off, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, _with(triton_qkv=False))
    assert not kept and qkv_off is not off
    release_decode_graphs(model)


def test_each_option_builds_its_own_loop_and_turns_its_part_off(parts):
    """A loop is kept per resolved DecodeOptions; with fuse_qkv, triton_mlp or fuse_rope off the
    loop plans none of that part."""
    from hf_zero3.decode import loop_cache as gd
    from hf_zero3.generation import release_decode_graphs

    model, cache, ids, cfg = parts
    default, _ = gd.loop_for(model, ids, [], cfg, None, None, cache, DEFAULTS)
    assert _part(default, features.FusedQKV).fused.names  # the tiny Llama's q/k/v fuse by default
    unfused, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, _with(fuse_qkv=False))
    assert not kept and unfused is not default and _part(unfused, features.FusedQKV).fused.names == ()
    for change in (dict(triton_mlp=False), dict(fuse_rope=False), dict(compile_prefill=False)):
        loop, kept = gd.loop_for(model, ids, [], cfg, None, None, cache, _with(**change))
        mlp, rope = _part(loop, features.MLPKernels), _part(loop, features.RopeAttention)
        assert not kept and mlp.names == () and rope.names == (), change  # CPU: neither part applies
    release_decode_graphs(model)


def test_a_compiled_prompt_forward_that_fails_as_it_runs_is_run_eagerly_on_an_emptied_cache(monkeypatch):
    """A compiled prompt forward whose code fails as it runs (as inductor's run-time assert on a
    cuDNN attention output did) after writing the cache: the prompt runs eagerly from an emptied
    cache, with the eager logits and cache, and the reason is kept for the model."""
    from transformers import StaticCache

    from hf_zero3.decode import caches, compiled
    from hf_zero3.decode.prefill import run_prefill
    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config()).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left-padded, two lengths
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    ref_cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        ref, how = run_prefill(model, ids, mask, positions, ref_cache, compile=False)
    assert how == "eager"

    def fails_as_it_runs(model, **kwargs):
        model(**kwargs)  # every layer written, as a compiled forward failing at its end would have
        raise TypeError("expected Tensor() for op: torch.ops.aten._scaled_dot_product_cudnn_attention.default")

    monkeypatch.setitem(caches.ONCE, compiled.prompt_logits, fails_as_it_runs)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        logits, how = run_prefill(model, ids, mask, positions, cache)
    assert how == "eager" and "failed as it ran (TypeError" in caches.PREFILL_FAILED[model]
    torch.testing.assert_close(logits, ref)
    for layer, expected in zip(cache.layers, ref_cache.layers):
        assert int(layer.cumulative_length) == int(expected.cumulative_length) == ids.shape[1]
        torch.testing.assert_close(layer.keys, expected.keys)
        torch.testing.assert_close(layer.values, expected.values)
    later = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():  # the model's later calls go straight to the eager prompt forward
        assert run_prefill(model, ids, mask, positions, later)[1] == "eager"


def test_the_report_names_a_feature_copy_that_moved(parts):
    """A feature's per-call copy (the fused q/k/v weights) at another address drops the graphs, and
    ``graphs_moved`` names that feature, not the cache."""
    from hf_zero3.decode.features import Feature
    from hf_zero3.decode.loop import DecodeLoop

    class WeightCopy(Feature):
        at = 1000

        @property
        def address(self) -> int:
            return self.at

    model, cache, ids, _ = parts
    copy = WeightCopy()
    loop = DecodeLoop(2, 16, ids.device, None, False, parts=[copy])
    loop.cache = cache
    loop.bind_cache()
    loop.graphs[1] = "captured"
    copy.at = 2000
    loop.bind_cache()
    assert loop.graphs == {} and loop.moved == ("WeightCopy",)
