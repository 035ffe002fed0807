"""transformers internals hf_zero3 relies on. Checked against transformers 5.17.0, 5.23.0 and
5.25.0 (``CHECKED``: CI's floor, pinned and newest sets).

Lockstep generation overrides private ``GenerationMixin`` methods that every decoding loop of
transformers 5.x goes through; the Trainer callback finds its ``Trainer`` from the
``on_init_end`` call (a callback is handed no reference to it). :func:`contract_problems` checks
every read the fast decode path makes of generation (the cache's keyword, the cache classes, the
overridden methods); the contract tests and ``hf_zero3 env`` call it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import inspect
import sys
import textwrap

import torch
import transformers
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    cache_utils,
)
from transformers.generation import utils as gen_utils
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.integrations import deepspeed as hf_ds
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .torch import hooks_suspended
from .versions import NEWEST, newer_than_checked

CHECKED = "transformers 5.17.0, 5.23.0, 5.25.0"

#: GenerationMixin methods lockstep generation overrides, in the order generate() calls them:
#: where ``max_length`` is fixed, the last validation before decoding, and the loop condition
#: (whose ``synced_gpus`` branch all-reduces over WORLD every step).
GENERATION_HOOKS = ("_prepare_generated_length", "_get_stopping_criteria", "_has_unfinished_sequences")
#: The encoder forward of an encoder-decoder model (its first collective), by release:
#: ``_maybe_prepare_encoder_kwargs_for_generation`` in 5.23, ``_prepare_encoder_decoder_kwargs_for_generation``
#: up to 5.17. One of them must exist.
ENCODER_HOOKS = ("_maybe_prepare_encoder_kwargs_for_generation", "_prepare_encoder_decoder_kwargs_for_generation")


#: Where transformers decides to decode with its compiled forward (lockstep's compiled decode
#: overrides it: compile only inside a whole-model region, see hf_zero3.generation.compiled_decode).
COMPILE_HOOK = "_valid_auto_compile_criteria"
#: transformers' sampling/greedy loop, and the arguments it is called with: lockstep's compiled
#: decode takes it over with hf_zero3's static loop (hf_zero3.decode.static_loop) and hands
#: every case that loop cannot do exactly back to it.
SAMPLE_HOOK = "_sample"
SAMPLE_PARAMS = (
    "self",
    "input_ids",
    "logits_processor",
    "stopping_criteria",
    "generation_config",
    "synced_gpus",
    "streamer",
    "model_kwargs",
)


#: Every private GenerationMixin method ``Zero3GenerationMixin`` overrides (the contract test
#: holds the mixin to this list and each method to its signature).
OVERRIDDEN = GENERATION_HOOKS + ENCODER_HOOKS + (COMPILE_HOOK, SAMPLE_HOOK)


# -- the KV cache's keyword ---------------------------------------------------------------------------
#: The keyword generation hands the KV cache through (``model_kwargs``, model inputs and outputs),
#: newest first: ``cache`` from transformers 5.25 (``past_key_values`` deprecated until 5.40),
#: ``past_key_values`` before (renamed in 5.25).
CACHE_KEYWORDS = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def cache_keyword() -> str | None:
    """The keyword this transformers passes the KV cache by (one of :data:`CACHE_KEYWORDS`; None: a
    release that renamed it again, which :func:`contract_problems` names and the fast decode path
    refuses with that reason)."""
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return next((k for k in CACHE_KEYWORDS if k in params), None)


def generation_cache(model_kwargs: dict):
    """The cache ``generate()`` prepared in ``model_kwargs`` (None: none, or an unknown keyword)."""
    key = cache_keyword()
    return model_kwargs.get(key) if key is not None else None


def passed_cache(kwargs: dict):
    """A cache the caller passed to ``generate()``, under either keyword (the old one still works,
    deprecated, on releases that renamed it)."""
    return next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)


def cache_arguments(cache) -> dict:
    """The keyword argument a model forward takes ``cache`` by."""
    return {cache_keyword() or CACHE_KEYWORDS[-1]: cache}


#: The cache classes the static loop reads: a ``StaticCache`` whose layers are all ``StaticLayer``
#: (``keys``, ``values``, ``max_cache_len``, ``cumulative_length``), as ``cache_implementation="static"`` builds it.
CACHE_CLASSES = ("StaticCache", "StaticLayer")


def recheck_generation() -> None:
    """Read transformers' generation again (:func:`cache_keyword`, :func:`contract_problems` are
    read once per process): after its code was patched."""
    cache_keyword.cache_clear()
    contract_problems.cache_clear()


@functools.lru_cache(maxsize=None)
def contract_problems() -> tuple[str, ...]:
    """What the fast decode path reads of transformers' generation and this release no longer has,
    one message each naming the read and the release (empty: all present; read once per process).
    Checked by the contract tests on every CI release set; ``hf_zero3 env`` prints it; a problem
    makes lockstep decode with transformers' own loop and say so."""
    release = f"transformers {transformers.__version__}"
    problems = []
    key = cache_keyword()
    if key is None:
        problems.append(
            f"{release}: GenerationMixin.prepare_inputs_for_generation takes none of {CACHE_KEYWORDS} "
            "(the KV cache's keyword)"
        )
    else:
        if key not in inspect.signature(LlamaForCausalLM.forward).parameters:
            problems.append(f"{release}: model forwards do not take the KV cache as {key!r}")
        fields = getattr(gen_utils.GenerateDecoderOnlyOutput, "__dataclass_fields__", {})
        if key not in fields:
            problems.append(f"{release}: GenerateDecoderOnlyOutput has no {key!r} field")
    problems += [
        f"{release}: transformers.cache_utils has no {c}" for c in CACHE_CLASSES if not hasattr(cache_utils, c)
    ]
    layer = getattr(cache_utils, "StaticLayer", None)
    if layer is not None and getattr(layer, "is_compileable", None) is not True:
        problems.append(f"{release}: StaticLayer.is_compileable is not True")
    if layer is not None:
        made = layer(max_cache_len=1)  # an empty layer: its fill count exists before any update
        if not isinstance(getattr(made, "cumulative_length", None), torch.Tensor):
            problems.append(f"{release}: a StaticLayer keeps no cumulative_length tensor (its fill count)")
    missing = [n for n in OVERRIDDEN if not hasattr(gen_utils.GenerationMixin, n) and n not in ENCODER_HOOKS]
    if not any(hasattr(gen_utils.GenerationMixin, n) for n in ENCODER_HOOKS):
        missing.append(" or ".join(ENCODER_HOOKS))
    problems += [f"{release}: GenerationMixin has no {n} (lockstep overrides it)" for n in missing]
    sample = getattr(gen_utils.GenerationMixin, SAMPLE_HOOK, None)
    if sample is not None and tuple(inspect.signature(sample).parameters)[: len(SAMPLE_PARAMS)] != SAMPLE_PARAMS:
        problems.append(f"{release}: GenerationMixin.{SAMPLE_HOOK} no longer takes {SAMPLE_PARAMS}")
    return tuple(problems)


def is_generation_model(module) -> bool:
    """A transformers generation model: it has ``GenerationMixin``'s loop condition."""
    return hasattr(module, "_has_unfinished_sequences")


def can_compile_fullgraph(model) -> bool:
    """transformers marks the model's forward compileable into one graph (``_can_compile_fullgraph``)."""
    return bool(getattr(model, "_can_compile_fullgraph", False))


def supports_attention_backend(model) -> bool:
    """The model looks its attention function up by name (transformers' attention interface)."""
    return bool(getattr(model, "_supports_attention_backend", False))


def attention_implementation(config) -> str | None:
    """The name the model looks its attention function up by (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


@contextlib.contextmanager
def attention_implementation_set(config, name: str):
    """Inside: the model of ``config`` attends with the function registered as ``name``."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def pad_token_tensor(generation_config):
    """The pad token ``generate()`` prepared on the config (``_pad_token_tensor``; None if unset)."""
    return getattr(generation_config, "_pad_token_tensor", None)


#: The transformers functions the fast decode path computes itself (hf_zero3.decode.families, and
#: the logits processors of hf_zero3.decode.logits_processors), each with the fingerprints of its
#: source (:func:`source_fingerprint`) in the releases it was checked against: transformers 5.17.0,
#: 5.23.0 and 5.25.0 (one fingerprint where they agree, else the newest first; the processors differ
#: in annotations, and 5.23.0's repetition penalty also drops ids past the output vocabulary, which
#: hf_zero3 computes too; 5.25.0's Llama attention takes the cache as ``cache`` and hands ``kwargs``
#: to ``cache.update``, which a ``StaticLayer``, the only layer the rope kernel takes, ignores). A
#: function whose source differs, or a transformers newer than the newest checked
#: (``versions.NEWEST``), falls back to the model's own code.
CHECKED_SOURCES = {
    "transformers.models.llama.modeling_llama.LlamaAttention.forward": ("8f5bc1437c7494f3", "6cc040820685adbf"),
    "transformers.models.llama.modeling_llama.apply_rotary_pos_emb": "d7bb227c70940011",
    "transformers.models.llama.modeling_llama.rotate_half": "b59dbfffe0eeb84b",
    "transformers.models.llama.modeling_llama.LlamaMLP.forward": "4a9e0f851f1aaf4d",
    "transformers.models.mistral.modeling_mistral.MistralMLP.forward": "4a9e0f851f1aaf4d",
    "transformers.models.qwen2.modeling_qwen2.Qwen2MLP.forward": "4a9e0f851f1aaf4d",
    "transformers.models.qwen3.modeling_qwen3.Qwen3MLP.forward": "4a9e0f851f1aaf4d",
    # 5.17-5.25: Llama's rotate-half rotary embedding, copied into Mistral, Qwen2, Qwen3
    "transformers.models.mistral.modeling_mistral.apply_rotary_pos_emb": "d7bb227c70940011",
    "transformers.models.mistral.modeling_mistral.rotate_half": "b59dbfffe0eeb84b",
    "transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb": "d7bb227c70940011",
    "transformers.models.qwen2.modeling_qwen2.rotate_half": "b59dbfffe0eeb84b",
    "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb": "d7bb227c70940011",
    "transformers.models.qwen3.modeling_qwen3.rotate_half": "b59dbfffe0eeb84b",
    # 5.17-5.25: the Llama RMSNorm and its copies
    "transformers.models.llama.modeling_llama.LlamaRMSNorm.forward": "fcd67d29c071c6be",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm.forward": "fcd67d29c071c6be",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm.forward": "fcd67d29c071c6be",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm.forward": "fcd67d29c071c6be",
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm.forward": "fcd67d29c071c6be",
    # 5.23-5.25, 5.17 (annotated FloatTensor)
    "transformers.models.phi3.modeling_phi3.Phi3MLP.forward": ("e5412905c5590476", "424174e77d92dbf7"),
    # 5.25 (the cache keyword ``cache``), 5.23 (also clears ``next_sequence_length``), 5.17
    "transformers.models.phi3.modeling_phi3.Phi3ForCausalLM.prepare_inputs_for_generation": (
        "0a2a1cc214e0740b",
        "5840db95a957482f",
        "931445e8dcc51322",
    ),
    # the window ring layers keep (hf_zero3.decode.ring_cache): the last ``sliding_window`` tokens
    "transformers.masking_utils.sliding_window_overlay": "1a46897c4520d5f0",
    "transformers.generation.logits_process.MinNewTokensLengthLogitsProcessor.__call__": (
        "6925b27f19d2dcf5",
        "6c78e5e631c971a5",
    ),
    "transformers.generation.logits_process.MinLengthLogitsProcessor.__call__": (
        "37ec104dde2492f8",
        "170a095a735d287f",
    ),
    "transformers.generation.logits_process.RepetitionPenaltyLogitsProcessor.__call__": (
        "149442a11dc04487",
        "5184b31942be6f8c",
    ),
}


_MODULE_OF: dict[str, int] = {}  # dotted path -> how many of its parts name its module (0: none)


def upstream_function(path: str):
    """The function at dotted ``path`` (``module.Class.function`` or ``module.function``), or None
    where this transformers has none. Where the module ends is found once per path: the decode path
    resolves these paths at every call, and trying each prefix through ``import_module`` (an import
    that fails, for ``module.Class``) costs far more than the lookup."""
    parts = path.split(".")
    split = _MODULE_OF.get(path)
    if split is None:
        split = 0
        for i in range(len(parts) - 1, 0, -1):
            try:
                importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            split = i
            break
        _MODULE_OF[path] = split
    if not split:
        return None
    name = ".".join(parts[:split])
    obj = sys.modules.get(name) or importlib.import_module(name)
    for attr in parts[split:]:
        obj = getattr(obj, attr, None)
    return hub_wrapped_function(obj, parts[-1])


def hub_wrapped_function(obj, name: str):
    """Works around transformers 5.25 requiring the ``kernels`` package: its
    ``use_kernel_forward_from_hub`` (on ``apply_rotary_pos_emb``) turns the decorated function into an
    ``nn.Module`` (``Func``) whose forward calls it unless the model was kernelized. The function it
    calls is the source that was checked; any other object is returned as it is."""
    if not isinstance(obj, torch.nn.Module):
        return obj
    for cell in getattr(type(obj).forward, "__closure__", None) or ():
        fn = cell.cell_contents
        if inspect.isfunction(fn) and fn.__name__ == name:
            return fn
    return obj


def source_fingerprint(fn) -> str:
    """A hash of ``fn``'s code as the parser reads it: comments, formatting, its docstring, its
    decorators and its name left out, so that only a change of what it computes changes it."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    node.body, node.decorator_list, node.name = body or [ast.Pass()], [], "f"
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


_FINGERPRINTS: dict = {}  # function object -> its fingerprint (a patched function is another object)


def unchecked_reason(path: str) -> str | None:
    """Why the function at ``path`` (a :data:`CHECKED_SOURCES` key) cannot be replaced by hf_zero3's
    computation (None: it is the source that was checked)."""
    fn = upstream_function(path)
    short = path.rpartition(".models.")[2]
    if fn is None:
        return f"transformers has no {short}"
    newer = newer_than_checked("transformers")  # the installed release
    if newer is not None:
        return (
            f"transformers {newer} is newer than the newest release hf_zero3 checked {short} against "
            f"({NEWEST['transformers']}); the model's own code runs there (`hf_zero3 env` lists what runs)"
        )
    try:
        got = _FINGERPRINTS.get(fn) or _FINGERPRINTS.setdefault(fn, source_fingerprint(fn))
    except (OSError, TypeError, SyntaxError) as exc:  # no source to read (a C function, a REPL)
        return f"the source of {short} cannot be read ({type(exc).__name__})"
    checked = CHECKED_SOURCES[path]
    checked = (checked,) if isinstance(checked, str) else checked
    if got not in checked:
        return (
            f"{short} is not the code hf_zero3 was checked against (fingerprint {got}, checked "
            f"{', '.join(checked)}: {CHECKED}); the model's own code runs there"
        )
    return None


def register_attention(name: str, attention) -> None:
    """Register ``attention`` under ``name``, with transformers' SDPA mask (a boolean mask, True
    where a query may attend) as its mask function: a model of transformers' attention interface
    (``_supports_attention_backend``) looks both up by ``config._attn_implementation`` (hf_zero3's
    decode attention, hf_zero3.decode.gqa_attention)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention():
    """transformers' SDPA attention function (the decode attention hands other shapes to it)."""
    return sdpa_attention_forward


def generation_config_field(name: str) -> bool:
    """Whether this transformers' ``GenerationConfig`` has the field ``name`` (``max_cache_len``:
    5.2x, not 5.17)."""
    return hasattr(GenerationConfig(), name)


def generation_hooks_present() -> None:
    """Refuse to run, naming the fix, if a release removed a method lockstep generation needs."""
    missing = [n for n in GENERATION_HOOKS if not hasattr(GenerationMixin, n)]
    if not any(hasattr(GenerationMixin, n) for n in ENCODER_HOOKS):
        missing.append(" or ".join(ENCODER_HOOKS))
    if missing:
        raise RuntimeError(
            f"hf_zero3 lockstep generation needs GenerationMixin.{', '.join(missing)}, which "
            f"transformers {transformers.__version__} no longer has; install a tested release "
            f"(transformers==5.23.0) or upgrade hf_zero3."
        )


def input_length_arg(args: tuple, kwargs: dict) -> int:
    """``input_ids_length`` as ``_prepare_generated_length`` receives it (keyword or 4th positional)."""
    return int(kwargs["input_ids_length"] if "input_ids_length" in kwargs else args[3])


def hf_deepspeed_config_ref():
    """transformers' process-wide weak reference to the live ``HfDeepSpeedConfig`` (tests swap it)."""
    return hf_ds._hf_deepspeed_config_weak_ref


def set_hf_deepspeed_config_ref(ref) -> None:
    hf_ds._hf_deepspeed_config_weak_ref = ref


# -- transformers: gradient_checkpointing_disable leaves the input-require-grads hook ----------------
# ``activation_checkpointing_enable`` registers a forward hook on the input embeddings of every LM
# (``enable_input_require_grads``); ``activation_checkpointing_disable`` removes it only for models
# with a transformers-integrated PEFT adapter (checked in 5.17 and 5.23; no upstream issue found).
# TRL disables and re-enables checkpointing around every rollout and every no-grad log-prob pass,
# so hooks pile up, two a step; the hook count is a torch.compile guard, so a compiled training
# step recompiles every step (under DeepCompile until the recompile limit, then runs eagerly).
def _own_input_grad_hooks(module) -> list:
    """The handles ``module.enable_input_require_grads()`` registered: a list since transformers
    added multi-embedding models (``_require_grads_hooks``), one handle before (``_require_grads_hook``)."""
    hooks = module.__dict__.get("_require_grads_hooks")
    if hooks is None:
        single = module.__dict__.get("_require_grads_hook")
        hooks = [single] if single is not None else []
    return list(hooks)


def input_grad_hooks(model) -> list:
    """The input-require-grads hook handles transformers registered on ``model``'s sub-models."""
    return [h for m in model.modules() for h in _own_input_grad_hooks(m)]


# The same hook calls ``output.requires_grad_()``, which Dynamo cannot trace (``Unsupported
# Tensor.requires_grad_() call``): a compiled decode step of a model with gradient checkpointing
# on (TRL's default, transformers 5.17's reentrant checkpointing, PEFT) would run eagerly. Under
# ``no_grad`` (generate()) the hook changes nothing: nothing downstream records a graph.
def input_grad_hooks_suspended(model):
    """Inside (with gradients off only): ``model``'s input-require-grads hooks do not run."""
    entries = []
    if not torch.is_grad_enabled():
        for handle in input_grad_hooks(model):
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                entries.append((hooks, handle.id))
    return hooks_suspended(entries)


def replace_input_grad_hooks_on_enable():
    """Make ``PreTrainedModel.enable_input_require_grads`` remove the hooks its previous call on the
    same model registered before registering new ones; returns the undo."""
    original = PreTrainedModel.__dict__["enable_input_require_grads"]

    @functools.wraps(original)
    def enable_input_require_grads(self):
        for handle in _own_input_grad_hooks(self):
            handle.remove()
        return original(self)

    PreTrainedModel.enable_input_require_grads = enable_input_require_grads
    return lambda: setattr(PreTrainedModel, "enable_input_require_grads", original)


def static_cache_counters_on(cache, device) -> int:
    """Works around transformers' ``StaticLayer`` keeping its fill count (``cumulative_length``) on
    the CPU until the layer's first update moves it (``.to(device)`` in ``lazy_initialization``;
    transformers 5.17-5.23, no upstream issue found; #45997 changed only its shape). Inside a
    compiled prompt forward each layer's move is a blocking host-to-device copy, so the host waits
    for the kernels queued before it, layer after layer: a large share of the prompt forward's host
    time (see the ablations in benchmarks/HISTORY.md). Each layer not initialized yet gets a
    counter of the same value made on ``device`` (a fill, no copy, no host sync); its move is then
    a no-op. Returns how many were replaced."""
    moved = 0
    for layer in getattr(cache, "layers", None) or ():
        n = vars(layer).get("cumulative_length")
        if (
            isinstance(n, torch.Tensor)
            and n.device.type == "cpu"
            and n.device != torch.device(device)
            and not getattr(layer, "is_initialized", False)
        ):
            layer.cumulative_length = torch.full(n.shape, int(n), dtype=n.dtype, device=device)
            moved += 1
    return moved


def sliding_layers_unslid(cache, length: int) -> int:
    """A sliding-window layer of the static cache (``StaticSlidingWindowLayer``, what
    ``cache_implementation="static"`` builds for a model with a ``config.sliding_window``, as
    Mistral's default config has, sized the smaller of the cache and the window) that holds
    ``length`` tokens never slides in a call of that length: the model's window mask (the
    config's window) then masks nothing causal masking does not. But the layer keeps its fill
    count as a Python int too, advanced on the host at each update, which a step replayed from a
    CUDA graph would not advance. So in a cache of static and sliding-window layers only, each
    sliding layer not used yet that holds ``length`` tokens becomes a ``StaticLayer`` as long as
    the cache's longest layer: the model builds one mask for all its sliding layers from the
    first one's sizes (a hybrid model's included), and with every layer one ``StaticLayer`` of one
    length that mask fits them all. Returns how many were replaced."""
    sliding = sliding_layer_class()
    layers = getattr(cache, "layers", None)
    if sliding is None or not isinstance(layers, list) or not layers:
        return 0
    if any(type(layer) not in (sliding, cache_utils.StaticLayer) for layer in layers):
        return 0
    size = max(layer.max_cache_len for layer in layers)
    replaced = 0
    for i, layer in enumerate(layers):
        if type(layer) is sliding and layer.max_cache_len >= length and not getattr(layer, "is_initialized", True):
            layers[i] = cache_utils.StaticLayer(max_cache_len=size)
            replaced += 1
    return replaced


def sliding_layer_lengths(cache) -> list[int]:
    """The sizes of ``cache``'s sliding-window static layers (after :func:`sliding_layers_unslid`:
    those a call would slide)."""
    sliding = sliding_layer_class()
    return [layer.max_cache_len for layer in getattr(cache, "layers", None) or () if type(layer) is sliding]


def sliding_layer_class():
    """transformers' ``StaticSlidingWindowLayer`` (None in a release without it)."""
    return getattr(cache_utils, "StaticSlidingWindowLayer", None)


def causal_lm_class(config):
    """The causal-LM class ``AutoModelForCausalLM`` builds for ``config`` (its model mapping: the
    class itself, to import before ``deepspeed.zero.Init`` wraps ``__init__``)."""
    return AutoModelForCausalLM._model_mapping[type(config)]


def linear_attention_layer_class():
    """transformers' ``LinearAttentionLayer`` (a linear-attention layer's conv and recurrent states,
    static tensors updated in place, as ``StaticCache`` builds it for Qwen3.5 / Qwen3-Next; None in a
    release without it)."""
    return getattr(cache_utils, "LinearAttentionLayer", None)


def linear_attention_layers(cache) -> int:
    """How many of ``cache``'s layers are linear-attention layers (:func:`linear_attention_layer_class`)."""
    linear = linear_attention_layer_class()
    return sum(type(layer) is linear for layer in getattr(cache, "layers", None) or ()) if linear else 0


def layer_state_tensors(layer) -> list[tuple[str, "object"]]:
    """(name, tensor) of every tensor a cache layer holds, those a linear-attention layer keeps in
    its per-state dicts (``conv_states``, ``recurrent_states``) included."""
    found = []
    for k, v in sorted(vars(layer).items()):
        if isinstance(v, torch.Tensor):
            found.append((k, v))
        elif isinstance(v, dict):
            found += [(f"{k}.{i}", t) for i, t in sorted(v.items()) if isinstance(t, torch.Tensor)]
    return found


def experts_implementation(model) -> str | None:
    """The expert computation a MoE model of transformers' experts interface runs
    (``config._experts_implementation``: ``grouped_mm`` by default where torch has it, ``batched_mm``,
    ``eager``), read from its first experts module (a class ``use_experts_implementation``
    decorated: it gives the class ``_apply_gate``); None for a model without one."""
    for m in model.modules():
        if hasattr(type(m), "_apply_gate") and hasattr(m, "config"):
            return getattr(m.config, "_experts_implementation", None)
    return None


#: What a decoder's forward says where it takes a prepared mask per layer type (``attention_mask``
#: as a mapping from ``config.layer_types`` entries to masks, as ``generate()`` may pass it): the
#: decoders of Gemma 2/3/4, gpt-oss, Qwen2/3 and Qwen3.5 in transformers 5.17-5.25.
MASK_MAPPING_SOURCE = "isinstance(causal_mask_mapping := attention_mask, dict)"


def mask_mapping_accepted(model) -> bool:
    """``model``'s decoder (its ``base_model``) takes ``attention_mask`` as a mapping from layer type
    to a prepared mask (:data:`MASK_MAPPING_SOURCE` in its forward's source)."""
    base = getattr(model, "base_model", model)
    try:
        return MASK_MAPPING_SOURCE in inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False


def decoder_only_output(sequences, cache):
    """What transformers' ``_sample`` returns under ``return_dict_in_generate`` when no per-step
    output was asked for: its output class with the sequences and the cache."""
    return GenerateDecoderOnlyOutput(sequences=sequences, **cache_arguments(cache))
