"""Compiled decoding inside lockstep generation: a static KV cache and transformers' compiled step.

With the whole model gathered once per call (``gather="all"``, or held by TRL's
``unwrap_model_for_generation``), a decode step runs no collective, and HF's eager loop is bound
by Python and kernel launches. Transformers already knows how to decode with a static KV cache
and a ``torch.compile``'d forward (``cache_implementation="static"``); lockstep turns it on when
the gathered region allows it and keeps every lockstep guarantee (the loop, its forwards and its
agreed stops are transformers' and ours as in eager decoding; only the forward is compiled).

* **When.** ``decode="compiled"``: always, unless the model or the options cannot (beam search,
  encoder-decoder models, a cache passed in or another cache implementation, a model transformers
  does not mark compileable), or the region gathers layer by layer (ZeRO-3's hooks run in every
  forward). ``decode="auto"`` (the default): the same, on CUDA only (beside DeepCompile's training
  graphs too: the decode step is its own compiled function, and DeepCompile's graph is not
  recompiled), and not where the generation config sets ``disable_compile``, except in the
  rollouts of a TRL trainer ``Zero3Safe`` adapted: TRL sets it (GRPO, RLOO, Distillation) to keep
  transformers from compiling, so there the call takes hf_zero3's static loop and, where that loop
  cannot take the call, decodes eagerly rather than through transformers' compiled loop.
  ``"compiled"`` overrides ``disable_compile`` for both loops. ``decode="eager"``: never. Each
  fallback says why once (``hf_zero3_last_generate.decode_reason``; one log line).
* **No recompiles across calls.** The static cache is sized to the prompt + new tokens rounded up
  to ``bucket`` tokens (transformers keeps the largest size seen, so later calls of any length up
  to it reuse the compiled step); leaving and re-entering the gathered region may give the
  parameters new storage of the same shape, which the compiled step's guards accept. A second
  batch size compiles once more (Dynamo marks the batch dimension dynamic); later sizes reuse it.
  ``hf_zero3_last_generate.compiles`` counts the Dynamo graphs a call compiled. Inside, hf_zero3's
  static loop (:mod:`.static_loop`) replaces transformers' per-token Python loop where it is exact.
"""

from __future__ import annotations

import logging
import math

import torch

from .._upstream import transformers as hf_up

DECODE_MODES = ("auto", "eager", "compiled")
log = logging.getLogger("hf_zero3.generation")
_SAID: set = set()


def say_eager(reason: str, loud: bool) -> None:
    """Why the call decodes eagerly, once per distinct reason."""
    say_once(f"eager decoding: {reason}", loud)


def say_once(message: str, loud: bool = False) -> None:
    """One log line per distinct message (why decoding fell back), a warning when ``loud``: a
    fallback on CUDA, where the user loses the fast path (see :func:`loud_on`), names
    ``hf_zero3 env``, which lists what this install can run."""
    if message not in _SAID:
        _SAID.add(message)
        if loud:
            log.warning("hf_zero3 lockstep: %s (`hf_zero3 env` lists what this install can run)", message)
        else:
            log.info("hf_zero3 lockstep: %s", message)


def loud_on(model, mode: str) -> bool:
    """A fallback is said as a warning: asked for (``decode="compiled"``), or on CUDA, where
    ``decode="auto"`` would have compiled (on the CPU the eager path is the default one)."""
    return mode == "compiled" or getattr(getattr(model, "device", None), "type", "cpu") == "cuda"


def _gen_value(model, kwargs: dict, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    gen_cfg = kwargs.get("generation_config")
    if gen_cfg is not None and getattr(gen_cfg, name, None) is not None:
        return getattr(gen_cfg, name)
    return getattr(getattr(model, "generation_config", None), name, default)


def resolve(model, mode: str, kwargs: dict, trl: str | None = None) -> tuple[bool, str | None]:
    """(compile the decode step?, why not). Local and cheap: a decode step gathers nothing inside a
    whole-model region, so ranks deciding differently still issue the same collectives (the call's
    first agreement gives them one stop schedule). ``trl``: the TRL trainer whose rollout this is (its
    ``disable_compile`` then keeps only transformers' compiled loop off: :func:`own_loop_only`)."""
    if mode == "eager":
        return False, "decode='eager'"
    reason = None
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        reason = "encoder-decoder model"
    elif (_gen_value(model, kwargs, "num_beams", 1) or 1) > 1:
        reason = "beam search (num_beams > 1)"
    elif hf_up.passed_cache(kwargs) is not None:
        reason = "a cache was passed in"
    elif _gen_value(model, kwargs, "cache_implementation") not in (None, "static"):
        reason = f"cache_implementation={_gen_value(model, kwargs, 'cache_implementation')!r}"
    elif not _gen_value(model, kwargs, "max_new_tokens"):
        # with max_length only, a rank with a longer prompt would decode past its static cache
        # while the group runs the agreed (largest) step budget
        reason = "max_new_tokens is not set (a static cache needs it)"
    elif _gen_value(model, kwargs, "use_cache") is False and trl is None:
        # TRL's GKD sets it while gradient checkpointing is on (a training-mode concern); in its
        # rollouts the static loop decodes with its cache, as the other TRL trainers do
        reason = "use_cache=False"
    elif own_loop_only(model, mode, kwargs) and trl is None:
        # decode="compiled" is an explicit request and overrides it
        reason = "disable_compile=True (decode='compiled' overrides it)"
    elif not hf_up.can_compile_fullgraph(model):
        reason = f"transformers does not mark {type(model).__name__} compileable (_can_compile_fullgraph)"
    elif mode == "auto" and getattr(getattr(model, "device", None), "type", "cpu") != "cuda":
        reason = "decode='auto' compiles on CUDA only (decode='compiled' forces it)"
    if reason is not None:
        say_eager(reason, loud=loud_on(model, mode))
        return False, reason
    return True, None


def own_loop_only(model, mode: str, kwargs: dict) -> bool:
    """``decode="auto"`` with ``disable_compile`` set: transformers' compiled loop stays off (read
    before :func:`prepare` clears it for the static cache)."""
    return mode == "auto" and bool(_gen_value(model, kwargs, "disable_compile"))


def prepare(model, args: tuple, kwargs: dict, bucket: int) -> None:
    """Ask transformers for a static cache sized to the bucketed length (in ``kwargs``)."""
    from .._upstream.transformers import generation_config_field

    kwargs.setdefault("cache_implementation", "static")
    kwargs["disable_compile"] = False
    kwargs["use_cache"] = True  # resolve() let through only a TRL rollout's use_cache=False
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    new = _gen_value(model, kwargs, "max_new_tokens")
    if (
        isinstance(inputs, torch.Tensor)
        and inputs.dim() == 2
        and new
        and generation_config_field("max_cache_len")
        and _gen_value(model, kwargs, "max_cache_len") is None
    ):  # a size the user chose stays
        kwargs["max_cache_len"] = int(math.ceil((inputs.shape[1] + int(new)) / bucket) * bucket)


def region_allows(gather: str) -> tuple[bool, str | None]:
    """The agreed gather strategy allows a compiled step (no ZeRO-3 hook runs inside it)."""
    if gather in ("all", "held"):
        return True, None
    return False, f"the model is gathered {gather!r} (ZeRO-3's hooks run in every forward)"


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process."""
    from .._upstream.torch import dynamo_graph_count

    return dynamo_graph_count()
