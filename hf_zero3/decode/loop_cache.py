"""Which loop a call decodes with: loops (static buffers and CUDA graphs) are kept per model and
shape, and a later call replays a kept loop's graphs only while everything a replayed graph reads
is what it was captured with (see :mod:`.static_loop`). The key is a fingerprint: the parameters'
and buffers' addresses, dtypes and autocast, and the model's plain state (what the compiled
forward's guards would check), computed on the host while the prompt's forward runs."""

from __future__ import annotations

import collections

import torch

from .._upstream import deepspeed as ds_up
from .._upstream import torch as torch_up
from ..options import DecodeOptions
from . import features, gqa_attention, logits_processors
from .caches import LOOPS
from .eligibility import cache_length
from .loop import DecodeLoop

KEEP = 2  # loops (static buffers and CUDA graphs) kept per model


_SCALARS = frozenset((bool, int, float, str, type(None)))
# nn.Module's own tables (parameters, buffers, submodules, hooks): never plain state (hooks are counted)
_MODULE_TABLES = frozenset(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, dict))


def _plain_state(obj, skip=None) -> tuple:
    """An object's plain attributes (flags, names, sizes: what Dynamo specializes a graph on),
    without those ``skip(name)`` is true for. One pass over ``vars(obj)``, type checks before any
    call, ``nn.Module``'s own tables (parameters, submodules, hooks: never plain) passed over by
    name: it runs over every module of the model once per call, while the prompt's forward runs."""
    items = []
    scalars, tables = _SCALARS, _MODULE_TABLES
    for k, v in vars(obj).items():
        t = type(v)
        if t not in scalars:
            if k in tables:
                continue
            if t is list or t is tuple or isinstance(v, (list, tuple)):
                if not all(type(x) is str for x in v):
                    continue
                v = tuple(v)
            elif (
                isinstance(v, dict)
                and v
                and all(type(x) in scalars for x in v.values())
                and all(type(x) is str for x in v)
            ):
                v = tuple(sorted(v.items()))  # PEFT's per-adapter scaling, r, lora_alpha
            else:
                continue
        if skip is None or not skip(k):
            items.append((k, v))
    return tuple(items)


def _module_state(model) -> tuple:
    """What a replayed graph cannot re-check and a compiled forward would (its guards): every
    module's flags and plain attributes (``training``, PEFT's active/disabled adapters), its hook
    counts, and the config's plain fields. ZeRO-3's own bookkeeping (``ds_*``, its pre-backward
    reference count, which a training step moves) is left out."""
    skip = ds_up.is_module_bookkeeping
    state = []
    for m in model.modules():
        state.append(_plain_state(m, skip))
        state.append(torch_up.forward_hook_counts(m))
    config = getattr(model, "config", None)
    if config is not None:
        state.append(_plain_state(config))
    return tuple(state)


def _loop_key(
    model,
    input_ids,
    processors,
    generation_config,
    eos_key,
    cache,
    attention: str | None,
    options: DecodeOptions,
) -> tuple[tuple, tuple] | None:
    """(what a loop's buffers and graphs are shaped by, the addresses and state they were captured
    with); None when a processor holds something other than plain values (its graph would bake
    in a tensor the next call may not pass again)."""
    procs = logits_processors.key(processors)
    if procs is None:
        return None
    dev = input_ids.device
    shape = (
        type(model),
        input_ids.shape[0],
        cache_length(cache),
        str(dev),
        bool(generation_config.do_sample),
        procs,
        eos_key,
        attention,
        options,
    )
    params = list(model.parameters())
    where = (
        tuple(t.data_ptr() for t in params),
        tuple(t.data_ptr() for t in model.buffers()),
        tuple(t.dtype for t in params),
        torch.is_autocast_enabled(dev.type),
        torch.get_autocast_dtype(dev.type),
        _module_state(model),
    )
    return shape, where


def loop_for(
    model, input_ids, processors, generation_config, eos, eos_key, cache, options: DecodeOptions
) -> tuple[DecodeLoop, bool]:
    """(the loop for this call, whether an earlier call's); at most ``KEEP`` per model, most recent
    first, and one per shape and ``options`` (resolved): a loop whose addresses or state no longer
    match is replaced. Host work only (no device sync): it runs while the prompt's forward does."""
    device = input_ids.device
    attention = gqa_attention.choice(
        model, device, input_ids.shape[0], options.triton_attention, eager=not options.compile_step
    )
    key = _loop_key(model, input_ids, processors, generation_config, eos_key, cache, attention, options)
    if key is not None:
        kept = LOOPS.setdefault(model, collections.OrderedDict())
        entry = kept.get(key[0])
        if entry is not None and entry[0] == key[1]:
            kept.move_to_end(key[0])
            return entry[1], True
    loop = DecodeLoop(
        input_ids.shape[0],
        cache_length(cache),
        input_ids.device,
        eos,
        bool(generation_config.do_sample),
        features.plan(model, device, attention, options),
        list(processors or ()),
        options.compile_step,
    )
    if key is not None:
        kept[key[0]] = (key[1], loop)
        kept.move_to_end(key[0])
        while len(kept) > KEEP:
            kept.popitem(last=False)
    return loop, False


def forget_loop(model, loop: DecodeLoop) -> None:
    kept = LOOPS.get(model, {})
    for shape in [s for s, (_, held) in kept.items() if held is loop]:
        del kept[shape]
