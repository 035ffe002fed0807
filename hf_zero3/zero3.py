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
    "group_world_size", "group_ranks", "deepcompile_active", "deepcompile_enabled", "offload_of",
    "zero3_hooks_suspended", "full_param_bytes", "device_of", "pending_optimizer_bytes",
    "deepcompile_handle", "replace_pending_schedule", "deepcompile_supported",
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


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None or WORLD: every rank)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


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


# --- DeepCompile internals (deepspeed.compile), read only here --------------------------------

def deepcompile_supported() -> tuple[bool, str]:
    """(supported, why not): DeepCompile needs a CUDA accelerator and torch >= 2.6."""
    try:
        from deepspeed.compile.util import is_deepcompile_supported
    except ImportError as exc:
        return False, f"this DeepSpeed has no DeepCompile ({exc}); pip install 'deepspeed>=0.18'"
    if not is_deepcompile_supported():
        return False, ("DeepCompile runs on CUDA only (DeepSpeed's accelerator here is "
                       f"{_accelerator_name()!r}, torch {torch.__version__}); train without "
                       "compile.deepcompile or on a CUDA machine")
    return True, ""


def _accelerator_name() -> str:
    try:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().device_name()
    except Exception:
        return "unknown"


def deepcompile_handle():
    """DeepCompile's native module (``set_persistent`` lives there)."""
    from deepspeed.compile.util import get_deepcompile_handle

    return get_deepcompile_handle()


def pending_optimizer_bytes(engine) -> int:
    """Device bytes the optimizer will allocate at its first step and has not yet.

    A plan made at step 0 (one compile instead of DeepSpeed's two) is profiled before Adam's
    ``exp_avg``/``exp_avg_sq`` exist; they are fp32 and partitioned like the fp32 master weights,
    so they are reserved from the budget here. 0 once the states exist, or when they live off the
    engine's device (optimizer offload).
    """
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", None)
    if inner is None or any(len(s) for s in getattr(inner, "state", {}).values()):
        return 0
    groups = getattr(opt, "fp32_partitioned_groups_flat", None) or []
    device = torch.device(getattr(engine, "device", "cpu"))
    on_device = [t for t in groups if isinstance(t, torch.Tensor) and t.device.type == device.type]
    numel = sum(t.numel() for t in on_device)
    name = type(inner).__name__.lower()
    per_param = 2 if "adam" in name or "lamb" in name else 1
    return numel * 4 * per_param


def replace_pending_schedule(engine, schedule) -> bool:
    """Swap the pass schedule of an engine that was compiled but has not run a compiled step yet
    (accelerate calls ``engine.compile`` with no schedule). Returns False when it is too late."""
    from deepspeed.compile import backend as dc_backend

    if not getattr(engine, "is_compiled", False) or getattr(engine, "global_steps", 0) > 0:
        return False
    if dc_backend.profiling_results or getattr(dc_backend, "next_passes", None):
        return False  # the first compiled forward already launched step 0's passes
    from deepspeed.compile.passes.contract import validate_schedule

    validate_schedule(schedule, dc_backend.opt_passes)
    fns = [(step, [p if callable(p) else dc_backend.opt_passes[p] for p in passes]) for step, passes in schedule]
    dc_backend.init_schedule(fns)
    return True
