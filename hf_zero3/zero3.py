"""Facts about a model or engine under ZeRO-3: the one module that reads DeepSpeed internals.

Everything else in hf_zero3 asks these questions through here (is a model partitioned, over which
group, is DeepCompile active, where are the eager ZeRO-3 hooks), so a DeepSpeed upgrade that moves
an attribute is mended in one file.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import OrderedDict
from typing import Any, Iterator

import torch
import torch.nn as nn

__all__ = [
    "unwrap", "engine_of", "is_zero3_param", "is_zero3_model", "zero3_params", "gather_group",
    "group_world_size", "deepcompile_active", "deepcompile_enabled", "offload_of",
    "zero3_hooks_suspended", "full_param_bytes", "device_of",
]

_ENGINES: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def unwrap(model_or_engine: Any) -> nn.Module:
    """The Hugging Face model inside a DeepSpeed engine / PEFT wrapper chain (the module itself
    for a plain model). PEFT models are returned as they are: their forward is the one to call."""
    if _is_engine(model_or_engine):
        _ENGINES[model_or_engine.module] = weakref.ref(model_or_engine)
        return model_or_engine.module
    return model_or_engine


def engine_of(model_or_engine: Any):
    """The ``DeepSpeedEngine`` that owns this model, or None if none was created (yet)."""
    if _is_engine(model_or_engine):
        return model_or_engine
    ref = _ENGINES.get(model_or_engine)
    engine = ref() if ref is not None else None
    if engine is not None:
        return engine
    for obj in _live_objects_named("DeepSpeedEngine"):
        if _contains(getattr(obj, "module", None), model_or_engine):
            _ENGINES[model_or_engine] = weakref.ref(obj)
            return obj
    return None


def _contains(root, module) -> bool:
    """``module`` is ``root`` or one of its submodules (a PEFT model's base model, say)."""
    if root is None:
        return False
    return root is module or any(m is module for m in root.modules())


def _is_engine(obj) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


def is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def zero3_params(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in unwrap(model).parameters() if is_zero3_param(p)]


def is_zero3_model(model: nn.Module) -> bool:
    """True when the model's parameters are ZeRO-3 partitioned (by ``zero.Init`` or an engine)."""
    return any(is_zero3_param(p) for p in unwrap(model).parameters())


def gather_group(model: nn.Module):
    """The process group the model's parameters are all-gathered over.

    ZeRO-3 partitions each parameter over ``param.ds_process_group`` (the data-parallel group,
    not necessarily WORLD). A model whose parameters use several groups (MoE experts) is refused:
    decisions must be agreed by one group that every rank of every gather belongs to.
    """
    import torch.distributed as dist

    groups = {}
    for p in zero3_params(model):
        g = getattr(p, "ds_process_group", None)
        if g is None:
            g = dist.group.WORLD
        groups[id(g)] = g
    if not groups:
        raise ValueError("gather_group: the model has no ZeRO-3 parameters")
    if len(groups) > 1:
        raise ValueError(
            f"the model's parameters are gathered over {len(groups)} different process groups "
            "(e.g. MoE expert parallelism); hf_zero3 needs one gather group per model. "
            "Pass group= explicitly with a group that contains every rank of every gather.")
    return next(iter(groups.values()))


def group_world_size(group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def deepcompile_enabled(engine) -> bool:
    """DeepCompile is switched on in the engine's config (``compile.deepcompile``)."""
    fn = getattr(engine, "is_deepcompile_enabled", None)
    return bool(fn()) if callable(fn) else False


def deepcompile_active(model_or_engine) -> bool:
    """``engine.compile()`` has run with DeepCompile: the eager ZeRO-3 hooks are gone and the
    compiled graph gathers parameters natively (invisible to ``param.ds_status``)."""
    engine = engine_of(model_or_engine)
    fn = getattr(engine, "is_deepcompile_active", None) if engine is not None else None
    return bool(fn()) if callable(fn) else False


def offload_of(model_or_engine):
    """The ``DeepSpeedZeRoOffload`` that owns the model's eager ZeRO-3 hooks, or None.

    An engine with a ZeRO-3 optimizer keeps it at ``optimizer.parameter_offload``; one built
    without an optimizer (reference models) uses the offload object as its ``optimizer``.
    """
    engine = engine_of(model_or_engine)
    if engine is not None:
        opt = getattr(engine, "optimizer", None)
        off = getattr(opt, "parameter_offload", None)
        if off is not None:
            return off
        if opt is not None and type(opt).__name__ == "DeepSpeedZeRoOffload":
            return opt
    module = unwrap(model_or_engine)
    for obj in _live_objects_named("DeepSpeedZeRoOffload"):
        if _contains(getattr(obj, "module", None), module):
            return obj
    return None


def _hook_ids(offload) -> set[int]:
    handles = list(getattr(offload, "forward_hooks", [])) + list(getattr(offload, "backward_hooks", []))
    pre = getattr(offload, "fwd_pre_hook", None)
    if pre is not None:
        handles.append(pre)
    return {h.id for h in handles}


@contextlib.contextmanager
def zero3_hooks_suspended(model_or_engine) -> Iterator[bool]:
    """Take DeepSpeed's per-module fetch/release hooks off the model for the duration.

    Used while every parameter is already gathered (or gathered by our own layer hooks): the
    eager hooks would otherwise re-partition each layer right after it runs and re-gather it on
    the next call. The hooks are restored in their original order, with the same ids, so
    DeepSpeed's trace and ``ds_id``s are untouched. Yields whether any hooks were live.
    """
    offload = offload_of(model_or_engine)
    if offload is None:
        yield False
        return
    ids = _hook_ids(offload)
    saved: list[tuple[nn.Module, str, OrderedDict]] = []
    for m in offload.module.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(m, attr)
            if any(k in ids for k in hooks):
                saved.append((m, attr, OrderedDict(hooks)))
                for k in [k for k in hooks if k in ids]:
                    del hooks[k]
    try:
        yield bool(saved)
    finally:
        for m, attr, hooks in saved:
            live = getattr(m, attr)
            added = OrderedDict((k, v) for k, v in live.items() if k not in hooks)
            live.clear()
            live.update(hooks)
            live.update(added)  # keep hooks that someone registered meanwhile


def full_param_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take when fully gathered on one rank."""
    total = 0
    for p in unwrap(model).parameters():
        numel = getattr(p, "ds_numel", None) if is_zero3_param(p) else p.numel()
        total += int(numel if numel is not None else p.numel()) * p.element_size()
    return total


def device_of(model: nn.Module) -> torch.device:
    """Where the model computes (a partitioned parameter's shard lives there)."""
    for p in unwrap(model).parameters():
        t = getattr(p, "ds_tensor", None)
        return (t if t is not None else p).device
    return torch.device("cpu")


def _live_objects_named(cls_name: str):
    """Find DeepSpeed objects nothing points us to (a bare module after ``initialize``)."""
    for obj in gc.get_objects():
        try:
            if type(obj).__name__ == cls_name:
                yield obj
        except ReferenceError:  # dead weakproxy
            continue
