"""The prompt's side of a static-loop call: its padding mask and positions, the EOS ids its
stopping criteria name, and its forward into the static cache (compiled, the prompt length
dynamic, else eager), queued before the loop is looked up so that host work overlaps it."""

from __future__ import annotations

import logging

import torch

from .._upstream import deepspeed as ds_up
from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from . import layer_compile
from .caches import PREFILL_FAILED
from .compiled import (
    COMPILE_ERRORS,
    RUN_ERRORS,
    bookkeeping_hooks_suspended,
    compiled_layer,
    compiled_once,
    failure_reason,
    forward_kwargs,
    prompt_logits,
)

log = logging.getLogger("hf_zero3.generation")


def prompt_inputs(input_ids, model_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's padding mask (long) and positions: the caller's, or transformers' from the mask."""
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return mask, positions.expand(input_ids.shape[0], -1)


def run_prefill(
    model, input_ids, mask, positions, cache, compile: bool = True, layers: str | None = None
) -> tuple[torch.Tensor, str]:
    """The prompt's forward into the static cache: (its last position's logits, "compiled",
    "layers" or "eager"). Compiled (``prompt_logits``) with the prompt length dynamic, so prompts
    of any length share one graph per batch size, and with the decode steps' hook suspensions; with
    ``layers`` (the decoder layers' name from :func:`.layer_compile.plan`, under
    :attr:`~hf_zero3.options.DecodeOptions.compile_layers`) the model's forward with each decoder
    layer through one compiled layer instead (:func:`_layered_prefill`); eager as transformers runs
    it, without DeepSpeed's per-linear autograd Function under ``no_grad``, where it does not
    compile or its compiled code fails as it runs (the reason kept per model, one log line) or
    without ``compile`` (:attr:`~hf_zero3.options.DecodeOptions.compile_prefill`). Compilation
    fails before any kernel runs, so the eager forward after it starts clean; after a run-time
    failure the static cache is emptied first."""
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **hf_up.cache_arguments(cache),
        **forward_kwargs(model),
    )
    if compile and model not in PREFILL_FAILED and hf_up.linear_attention_layers(cache):
        # measured (benchmarks/RESULTS.md, Model families): Dynamo unrolls the chunk loop of the
        # gated delta rule's prompt form, and a Qwen3.5-shaped prompt forward had not compiled
        # after minutes on an H100; the decode steps (one token: the recurrent form) compile in seconds
        PREFILL_FAILED[model] = (
            "the prompt's forward runs eagerly for a cache with linear-attention layers "
            "(compiling their chunked prompt form takes minutes)"
        )
    if compile and layers is not None and model not in PREFILL_FAILED:
        try:
            out = _layered_prefill(model, cache, kwargs, layers)
        except torch.OutOfMemoryError:
            raise
        except RUN_ERRORS as exc:  # a compiled layer's code failed as it ran: as the compiled forward's
            PREFILL_FAILED[model] = why = f"the compiled prompt layer failed as it ran ({failure_reason(exc)})"
            log.warning("hf_zero3 lockstep: eager prefill: %s", why)
            cache.reset()
        else:
            if out is not None:
                return out
    if compile and model not in PREFILL_FAILED:  # the whole forward (or where the layers could not bind)
        dims = {}
        for name in ("input_ids", "attention_mask", "position_ids"):
            # contiguous (a sliced prompt's row stride is not its length: Dynamo would guard on
            # that and compile again) and a new view, so the mark stays off the caller's tensor
            t = kwargs[name].contiguous().view(kwargs[name].shape)
            if t.shape[1] > 1:
                torch_up.mark_dynamic_if_possible(t, 1)
            dims[name] = t
        try:
            with bookkeeping_hooks_suspended(model), torch_up.hook_guards():
                return compiled_once(prompt_logits)(model, **{**kwargs, **dims}), "compiled"
        except COMPILE_ERRORS as exc:
            PREFILL_FAILED[model] = why = (
                f"the prompt's forward does not compile into one graph ({failure_reason(exc)})"
            )
            log.warning("hf_zero3 lockstep: eager prefill: %s", why)
        except torch.OutOfMemoryError:
            raise
        except RUN_ERRORS as exc:
            # the compiled code failed as it ran (a backend's kernel or one of inductor's run-time
            # asserts): the eager forward computes the same logits; local, as a prefill gathers nothing
            PREFILL_FAILED[model] = why = f"the compiled prompt forward failed as it ran ({failure_reason(exc)})"
            log.warning("hf_zero3 lockstep: eager prefill: %s", why)
            cache.reset()  # the layers it wrote before failing start again from an empty cache
    with ds_up.zero3_linear_without_autograd():
        return model(**kwargs).logits[:, -1], "eager"


def _layered_prefill(model, cache, kwargs: dict, name: str) -> tuple[torch.Tensor, str] | None:
    """The prompt's forward as the model's own, each decoder layer through one compiled layer
    (:mod:`.layer_compile`; its own graph, apart from the decode step's): (logits, "layers"), or
    (logits, "eager") where a layer did not compile (the reason kept per model), or None where the
    layers cannot be bound (nothing ran)."""
    layers = layer_compile.Layers(name)
    if not layers.bind(model, cache, compiled_layer(prompt=True)):
        return None
    try:
        with bookkeeping_hooks_suspended(model), ds_up.zero3_linear_without_autograd(), layers.use():
            logits = model(**kwargs).logits[:, -1]
    finally:
        layers.end()
    if layers.failed is not None:
        PREFILL_FAILED[model] = why = f"the prompt's layer does not compile into one graph ({layers.failed})"
        log.warning("hf_zero3 lockstep: eager prefill: %s", why)
        return logits, "eager"
    return logits, "layers"


def eos_ids(stopping_criteria, device) -> torch.Tensor | None:
    ids = [c.eos_token_id for c in stopping_criteria or () if hasattr(c, "eos_token_id")]
    if not ids:
        return None
    return torch.cat([torch.as_tensor(i, device=device).flatten() for i in ids]).to(torch.long)
