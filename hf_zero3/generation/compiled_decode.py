"""Compiled decoding inside lockstep generation: a static KV cache and a compiled step.

With the whole model gathered once per call (``gather="all"``, or held by TRL's
``unwrap_model_for_generation``), a decode step runs no collective, and HF's eager loop is bound
by Python and kernel launches. Transformers already knows how to decode with a static KV cache
and a ``torch.compile``'d forward (``cache_implementation="static"``); lockstep turns it on when
the gathered region allows it and keeps every lockstep guarantee (the loop, its forwards and its
agreed stops are transformers' and ours as in eager decoding; only the forward is compiled).

* **When** is :func:`hf_zero3.decode.plan.plan`'s to say; here the call's static cache is asked
  for (:func:`prepare`) and a fallback said once (:func:`say_eager`).
* **No recompiles across calls.** The static cache is sized to the prompt + new tokens rounded up
  to ``bucket`` tokens (transformers keeps the largest size seen, so later calls of any length up
  to it reuse the compiled step); leaving and re-entering the gathered region may give the
  parameters new storage of the same shape, which the compiled step's guards accept. A second
  batch size compiles once more (Dynamo marks the batch dimension dynamic); later sizes reuse it.
  ``hf_zero3_last_generate.compiles`` counts the Dynamo graphs a call compiled. Inside, hf_zero3's
  static loop (:mod:`hf_zero3.decode.static_loop`) replaces transformers' per-token Python loop where it is exact.
"""

from __future__ import annotations

import logging
import math

import torch

from .._upstream.torch import dynamo_graph_count
from .._upstream.transformers import generation_config_field
from ..decode.plan import gen_value

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


def prepare(model, args: tuple, kwargs: dict, bucket: int) -> None:
    """Ask transformers for a static cache sized to the bucketed length (in ``kwargs``)."""
    kwargs.setdefault("cache_implementation", "static")
    kwargs["disable_compile"] = False
    kwargs["use_cache"] = True  # the plan let through only a TRL rollout's use_cache=False
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    new = gen_value(model, kwargs, "max_new_tokens")
    if (
        isinstance(inputs, torch.Tensor)
        and inputs.dim() == 2
        and new
        and generation_config_field("max_cache_len")
        and gen_value(model, kwargs, "max_cache_len") is None
    ):  # a size the user chose stays
        kwargs["max_cache_len"] = int(math.ceil((inputs.shape[1] + int(new)) / bucket) * bucket)


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process."""
    return dynamo_graph_count()
