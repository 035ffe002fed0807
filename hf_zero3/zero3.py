"""Facts about a model or engine under ZeRO-3: partitioned? over which group? how big gathered?

Built on :mod:`hf_zero3._upstream.deepspeed` (the only reader of DeepSpeed's attributes) and the
model's :class:`~hf_zero3.runtime.Runtime` (which knows its engine): no heap scans.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from ._upstream import deepspeed as ds_up
from ._upstream import torch as torch_up

__all__ = [
    "unwrap",
    "engine_of",
    "is_zero3_param",
    "is_zero3_model",
    "zero3_params",
    "gather_group",
    "group_world_size",
    "group_ranks",
    "gather_ranks",
    "deepcompile_active",
    "zero3_hooks_suspended",
    "full_param_bytes",
    "device_of",
]

is_zero3_param = ds_up.is_zero3_param


def unwrap(model_or_engine: Any) -> nn.Module:
    """The module inside a DeepSpeed engine (the module itself otherwise; PEFT models stay as they
    are: their forward is the one to call). Attaches the engine to the module's runtime."""
    if ds_up.is_engine(model_or_engine):
        from .runtime import runtime_of

        runtime_of(model_or_engine)
        return ds_up.engine_module(model_or_engine)
    return model_or_engine


def engine_of(model_or_engine: Any):
    """The ``DeepSpeedEngine`` of this model, if an entry point was handed it (None otherwise)."""
    if ds_up.is_engine(model_or_engine):
        return model_or_engine
    from .runtime import runtime_of

    rt = runtime_of(model_or_engine, create=False)
    return rt.engine if rt is not None else None


def zero3_params(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in unwrap(model).parameters() if is_zero3_param(p)]


def is_zero3_model(model: nn.Module) -> bool:
    """True when the model's parameters are ZeRO-3 partitioned (by ``zero.Init`` or an engine)."""
    return any(is_zero3_param(p) for p in unwrap(model).parameters())


def gather_group(model: nn.Module):
    """The process group the model's parameters are all-gathered over.

    ZeRO-3 partitions each parameter over its data-parallel group (not necessarily WORLD). A model
    whose parameters use several groups (MoE experts) is refused: decisions must be agreed by one
    group that every rank of every gather belongs to.
    """
    import torch.distributed as dist

    groups = {}
    for p in zero3_params(model):
        g = ds_up.param_group(p)
        if g is None:
            g = dist.group.WORLD
        groups[id(g)] = g
    if not groups:
        raise ValueError("gather_group: the model has no ZeRO-3 parameters")
    if len(groups) > 1:
        raise ValueError(
            f"the model's parameters are gathered over {len(groups)} different process groups "
            "(e.g. MoE expert parallelism); hf_zero3 needs one gather group per model. "
            "Pass group= explicitly with a group that contains every rank of every gather."
        )
    return next(iter(groups.values()))


def group_world_size(group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None or WORLD: every rank)."""
    from .agree import group_ranks as ranks

    return ranks(group)


def gather_ranks(model: nn.Module) -> set[int]:
    """Every global rank any of the model's parameters is gathered over (the union of their groups)."""
    import torch.distributed as dist

    groups = {id(g): g for g in (ds_up.param_group(p) or dist.group.WORLD for p in zero3_params(model))}
    return {r for g in groups.values() for r in group_ranks(g)}


def deepcompile_active(model_or_engine) -> bool:
    """``engine.compile()`` has run with DeepCompile: the eager ZeRO-3 hooks are gone and the
    compiled graph gathers parameters natively."""
    from .runtime import runtime_of

    return runtime_of(model_or_engine).deepcompile_active()


@contextlib.contextmanager
def zero3_hooks_suspended(model_or_engine) -> Iterator[bool]:
    """Take DeepSpeed's per-module fetch/release hooks off the model for the duration.

    Used while every parameter is already gathered (or gathered by our own layer hooks): the
    eager hooks would otherwise re-partition each layer right after it runs and re-gather it on
    the next call. The hooks are restored in their original order, with the same ids, so
    DeepSpeed's trace and ``ds_id``s are untouched, also when the block raises. Yields whether
    any hooks were live.
    """
    from .runtime import runtime_of

    offload = runtime_of(model_or_engine).offload()
    if offload is None:
        yield False
        return
    ids = ds_up.offload_hook_ids(offload)
    entries = [
        (hooks, k)
        for m in ds_up.offload_module(offload).modules()
        for _name, hooks in ds_up.module_hook_dicts(m)
        for k in hooks
        if k in ids
    ]
    with torch_up.hooks_suspended(entries):
        yield bool(entries)


def full_param_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take when fully gathered on one rank."""
    total = 0
    for p in unwrap(model).parameters():
        numel = ds_up.param_full_numel(p) if is_zero3_param(p) else p.numel()
        total += int(numel) * p.element_size()
    return total


def device_of(model: nn.Module) -> torch.device:
    """Where the model computes (a partitioned parameter's shard lives there)."""
    for p in unwrap(model).parameters():
        return (ds_up.param_shard(p) if is_zero3_param(p) else p).device
    return torch.device("cpu")
