"""Facts about a model or engine under ZeRO-3: partitioned? over which group? how big gathered?

Built on :mod:`hf_zero3._upstream.deepspeed` (the only reader of DeepSpeed's attributes) alone:
what needs the model's engine or hf_zero3's state about it (:func:`~hf_zero3.runtime.unwrap`,
:func:`~hf_zero3.runtime.engine_of`, DeepCompile, the eager hooks) lives in
:mod:`hf_zero3.runtime`, one layer up. No heap scans.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import agree
from ._upstream import deepspeed as ds_up

is_zero3_param = ds_up.is_zero3_param


def module_of(model_or_engine: Any) -> nn.Module:
    """The module inside a DeepSpeed engine (the module itself otherwise; PEFT models stay as they
    are). Records nothing: :func:`hf_zero3.runtime.unwrap` also attaches the engine."""
    return ds_up.engine_module(model_or_engine) if ds_up.is_engine(model_or_engine) else model_or_engine


def zero3_params(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module_of(model).parameters() if is_zero3_param(p)]


def is_zero3_model(model: nn.Module) -> bool:
    """True when the model's parameters are ZeRO-3 partitioned (by ``zero.Init`` or an engine)."""
    return any(is_zero3_param(p) for p in module_of(model).parameters())


def gather_group(model: nn.Module):
    """The process group the model's parameters are all-gathered over.

    ZeRO-3 partitions each parameter over its data-parallel group (not necessarily WORLD). A model
    whose parameters use several groups (MoE experts) is refused: decisions must be agreed by one
    group that every rank of every gather belongs to.
    """
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
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None or WORLD: every rank)."""
    return agree.group_ranks(group)


def gather_ranks(model: nn.Module) -> set[int]:
    """Every global rank any of the model's parameters is gathered over (the union of their groups)."""
    groups = {id(g): g for g in (ds_up.param_group(p) or dist.group.WORLD for p in zero3_params(model))}
    return {r for g in groups.values() for r in group_ranks(g)}


def full_param_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take when fully gathered on one rank."""
    total = 0
    for p in module_of(model).parameters():
        numel = ds_up.param_full_numel(p) if is_zero3_param(p) else p.numel()
        total += int(numel) * p.element_size()
    return total


def device_of(model: nn.Module) -> torch.device:
    """Where the model computes (a partitioned parameter's shard lives there)."""
    for p in module_of(model).parameters():
        return (ds_up.param_shard(p) if is_zero3_param(p) else p).device
    return torch.device("cpu")
