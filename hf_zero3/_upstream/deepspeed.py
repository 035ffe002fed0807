"""DeepSpeed internals hf_zero3 reads: ZeRO-3 parameter attributes, the engine, the eager hooks'
owner, and DeepCompile's module-level state.

Checked against DeepSpeed 0.19.8 (``CHECKED``); each accessor has a contract test in
``tests/cpu/test_upstream_contracts.py`` (DeepCompile's on CUDA only, in ``tests/gpu``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.compile import backend as dc_backend
from deepspeed.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract, validate_schedule
from deepspeed.compile.profilers import graph_profile
from deepspeed.compile.util import get_deepcompile_handle, is_deepcompile_supported
from deepspeed.runtime.zero import linear as zero_linear
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .torch import hooks_suspended

CHECKED = "deepspeed 0.19.8"

# --- ZeRO-3 parameters (attributes DeepSpeed sets on each partitioned parameter) ----------------


def is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def param_group(p):
    """The process group ``p`` is all-gathered over (None: WORLD)."""
    return getattr(p, "ds_process_group", None)


def param_full_numel(p) -> int:
    return int(p.ds_numel)


def param_shard(p) -> torch.Tensor:
    return p.ds_tensor


def param_id(p) -> int:
    """DeepSpeed's process-wide parameter id (``Init.param_id`` counter: unique across models)."""
    return int(p.ds_id)


def param_available(p) -> bool:
    """Gathered on this rank right now (by an engine hook, ``GatheredParameters`` or TRL)."""
    return p.ds_status == ZeroParamStatus.AVAILABLE


def gather_now(params: list) -> None:
    """All-gather ``params`` (a collective over their group); partitioned ones only."""
    todo = [p for p in params if not param_available(p)]
    if todo:
        todo[0].all_gather(param_list=todo)


def partition_now(params: list) -> None:
    """Release gathered ``params`` back to their shards (local: no collective)."""
    done = [p for p in params if param_available(p)]
    if done:
        done[0].partition(param_list=done, has_been_updated=False)


def gathered_parameters(params: list):
    """``deepspeed.zero.GatheredParameters`` for reading (no modifier rank: no broadcast on exit)."""
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


# --- the engine ---------------------------------------------------------------------------------


def is_engine(obj) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


def engine_module(engine) -> nn.Module:
    return engine.module


def engine_global_steps(engine) -> int:
    return int(getattr(engine, "global_steps", 0) or 0)


def engine_zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def deepcompile_enabled(engine) -> bool:
    """DeepCompile is switched on in the engine's config (``compile.deepcompile``)."""
    fn = getattr(engine, "is_deepcompile_enabled", None)
    return bool(fn()) if callable(fn) else False


def deepcompile_active(engine) -> bool:
    """``engine.compile()`` ran with DeepCompile: the eager ZeRO-3 hooks are gone and the compiled
    graph gathers parameters natively (invisible to ``ds_status``)."""
    fn = getattr(engine, "is_deepcompile_active", None)
    return bool(fn()) if callable(fn) else False


def engine_is_compiled(engine) -> bool:
    return bool(getattr(engine, "is_compiled", False))


def engine_offload(engine):
    """The ``DeepSpeedZeRoOffload`` owning the engine's eager ZeRO-3 hooks, or None. An engine with a
    ZeRO-3 optimizer keeps it at ``optimizer.parameter_offload``; one built without an optimizer
    (reference models) uses the offload object as its ``optimizer``."""
    opt = getattr(engine, "optimizer", None)
    off = getattr(opt, "parameter_offload", None)
    if off is not None:
        return off
    if opt is not None and type(opt).__name__ == "DeepSpeedZeRoOffload":
        return opt
    return None


def offload_from_module_hooks(module: nn.Module):
    """The ``DeepSpeedZeRoOffload`` whose eager hooks sit on ``module`` (found through the closure of
    its ``_start_of_forward_hook``), or None. Lets a bare module handed to ``deepspeed.initialize``
    be served without a reference to its engine and without scanning the heap."""
    for hook in list(module._forward_pre_hooks.values()):
        found = _closure_object(hook, "DeepSpeedZeRoOffload", depth=3)
        if found is not None and getattr(found, "module", None) is module:
            return found
    return None


# DeepSpeed's engine runs its forward prologue/epilogue (throughput and wall-clock timers, ZeRO-3's
# external-parameter flag, fp16 input casting, the flops profiler) as forward hooks on the module
# itself (``engine.module_forward_pre_hook`` / ``module_forward_post_hook``), so they run inside
# any ``torch.compile`` of the module's ``__call__``. Once the engine has stepped twice (the
# throughput timer's ``start_step``) the prologue syncs the device and reads ``time.time()``, which
# Dynamo cannot trace: a compiled decode step stopped compiling at a user's third rollout (found by
# the GRPO GPU test, reproduced on CPU with torch 2.11). None of it applies to a decode step in a
# gathered region: its parameters are all present and its inputs are token ids.
ENGINE_FORWARD_HOOKS = ("_module_forward_pre_hook", "_module_forward_post_hook")


def engine_forward_hooks(module: nn.Module) -> list[tuple[dict, int]]:
    """(hook table, handle id) of the prologue/epilogue hooks a ``DeepSpeedEngine`` put on
    ``module``; none for an engine that casts floating-point inputs to fp16 in its prologue
    (``fp16.auto_cast``): that cast is not bookkeeping."""
    found = []
    for _, table in module_hook_dicts(module):
        for key, fn in list(table.items()):
            if getattr(fn, "__name__", None) not in ENGINE_FORWARD_HOOKS:
                continue
            engine = _closure_object(fn, "DeepSpeedEngine", depth=1)
            cast = getattr(engine, "fp16_auto_cast", None)
            if engine is not None and not (callable(cast) and cast()):
                found.append((table, key))
    return found


def remove_engine_forward_hooks(engine) -> None:
    """Remove ``engine``'s forward prologue/epilogue hooks from its module: ``destroy()`` leaves
    them (DeepSpeed 0.19.8), and a freed engine's prologue would still run in every forward of a
    module a new engine wraps."""
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)


def engine_forward_hooks_suspended(module: nn.Module):
    """Inside: the engine's forward prologue/epilogue hooks on ``module`` do not run."""
    return hooks_suspended(engine_forward_hooks(module))


# ``deepspeed.zero.Init`` (with its default ``mem_efficient_linear=True``) replaces
# ``torch.nn.functional.linear`` for the whole process with ``zero3_linear_wrap``, an autograd
# Function (it re-gathers the weight in backward instead of saving it gathered), and leaves it so
# ("This will persist unless manually reset"). Every ``nn.Linear`` call then pays
# ``Function.apply`` and an ``inspect.signature`` binding, also under ``no_grad``: an eager prompt
# forward, host-bound already, spends a large share of its host time there (see the ablations in
# benchmarks/HISTORY.md). Under ``no_grad`` the Function has
# no backward to prepare: its own forward (``LinearFunctionForZeroStage3.forward``, the same
# kernels) can be called directly.


def _zero3_linear_function():
    return getattr(zero_linear, "zero3_linear_wrap", None), getattr(zero_linear, "LinearFunctionForZeroStage3", None)


@contextlib.contextmanager
def zero3_linear_without_autograd():
    """Inside, in a ``no_grad`` region: ``F.linear``, where DeepSpeed replaced it, runs DeepSpeed's
    linear forward without its autograd Function (the same result bit for bit; with grad enabled
    the Function as before). Nothing changes where ``F.linear`` is not DeepSpeed's."""
    wrap, function = _zero3_linear_function()
    if wrap is None or function is None or F.linear is not wrap:
        yield
        return

    def linear(input, weight, bias=None):
        if torch.is_grad_enabled():
            return wrap(input, weight, bias)
        return function.forward(input, weight, bias)

    F.linear = linear
    try:
        yield
    finally:
        if F.linear is linear:
            F.linear = wrap


# Attributes ZeRO-3 keeps on every module for its own bookkeeping: ``ds_*`` (ids, counters,
# registries) and the pre-backward hook's reference count, which grows with every training step
# (``parameter_offload._pre_backward_module_hook``). A forward reads none of them.
MODULE_COUNTERS = ("applied_pre_backward_ref_cnt",)


def is_module_bookkeeping(name: str) -> bool:
    """``name`` is an attribute ZeRO-3 sets on modules for itself (not model state)."""
    return name.startswith("ds_") or name in MODULE_COUNTERS


def _closure_object(fn, cls_name: str, depth: int):
    if depth < 0:
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if any(c.__name__ == cls_name for c in type(value).__mro__):  # subclasses too (hybrid, pipeline engines)
            return value
        if callable(value):
            found = _closure_object(value, cls_name, depth - 1)
            if found is not None:
                return found
    return None


def offload_module(offload) -> nn.Module:
    return offload.module


def offload_hook_ids(offload) -> set[int]:
    """Ids of the hook handles DeepSpeed registered for its eager fetch/release."""
    handles = list(getattr(offload, "forward_hooks", [])) + list(getattr(offload, "backward_hooks", []))
    pre = getattr(offload, "fwd_pre_hook", None)
    if pre is not None:
        handles.append(pre)
    return {h.id for h in handles}


def module_hook_dicts(module: nn.Module) -> Iterator[tuple[str, dict]]:
    """torch's per-module hook tables the eager ZeRO-3 hooks live in."""
    yield "_forward_pre_hooks", module._forward_pre_hooks
    yield "_forward_hooks", module._forward_hooks


def accumulation_boundary(engine) -> bool:
    """The coming ``engine.step()`` ends a gradient-accumulation cycle (the optimizer steps); True
    for an object without DeepSpeed's ``is_gradient_accumulation_boundary``."""
    fn = getattr(engine, "is_gradient_accumulation_boundary", None)
    return bool(fn()) if callable(fn) else True


def pending_optimizer_bytes(engine) -> int:
    """Device bytes the optimizer will allocate at its first step and has not yet.

    A plan made at step 0 is profiled before Adam's ``exp_avg``/``exp_avg_sq`` exist; they are fp32
    and partitioned like the fp32 master weights. 0 once the states exist, or when they live off
    the engine's device (optimizer offload).
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


# --- DeepCompile (deepspeed.compile) ------------------------------------------------------------


def deepcompile_supported() -> tuple[bool, str]:
    """(supported, why not): DeepCompile needs a CUDA accelerator and torch >= 2.6."""
    if not is_deepcompile_supported():
        return False, (
            "DeepCompile runs on CUDA only (DeepSpeed's accelerator here is "
            f"{_accelerator_name()!r}, torch {torch.__version__}); train without "
            "compile.deepcompile or on a CUDA machine"
        )
    return True, ""


def _accelerator_name() -> str:
    try:
        return get_accelerator().device_name()
    except Exception:
        return "unknown"


def deepcompile_handle():
    """DeepCompile's native module (``set_persistent`` lives there)."""
    return get_deepcompile_handle()


def register_compile_pass(name: str, fn, contract) -> None:
    """Put ``fn`` in DeepCompile's process-wide pass table under ``name``."""
    dc_backend.register_compile_pass(name, fn, contract)


def gather_release_contract(conflicts: frozenset):
    """A ``PassContract`` for a pass that reorders zero3_compile's all-gathers."""
    return PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}), conflicts_with=conflicts)


def graph_param_ids(param_manager, graph_id) -> set[int]:
    """DeepSpeed parameter ids (``ds_id``) of the parameters a compiled graph takes as inputs."""
    manager = param_manager.get(graph_id) if hasattr(param_manager, "get") else None
    if manager is None:
        return set()
    return {int(i) for i in manager.ds_ids.values()}


def replace_pending_schedule(engine, schedule) -> bool:
    """Swap the pass schedule of an engine that was compiled but has not run a compiled step yet
    (accelerate calls ``engine.compile`` with no schedule). Returns False when it is too late."""
    if not engine_is_compiled(engine) or engine_global_steps(engine) > 0:
        return False
    launched_early = _LAUNCHED_EARLY in vars(engine)
    if dc_backend.profiling_results or (getattr(dc_backend, "next_passes", None) and not launched_early):
        return False  # the first compiled forward already launched step 0's passes
    validate_schedule(schedule, dc_backend.opt_passes)
    fns = [(step, [p if callable(p) else dc_backend.opt_passes[p] for p in passes]) for step, passes in schedule]
    dc_backend.init_schedule(fns)
    if launched_early:  # step 0's passes were launched before a rollout: launch the new ones alike
        engine.__dict__.pop(_LAUNCHED_EARLY)
        launch_pending_compile_passes(engine)
    return True


# DeepCompile launches the passes scheduled for a step at that step's first training forward, and
# launching resets Dynamo process-wide (``torch._dynamo.reset()`` in ``launch_compile_passes``,
# deepspeed/compile/backend.py, DeepSpeed 0.19.8; no upstream issue found): every function compiled
# before it compiles again at its next call. A rollout before the first training step (GRPO's first
# step generates, then trains) compiled the static loop, which DeepCompile's step-0 launch then
# discarded, so the second rollout compiled it again (benchmarks/HISTORY.md, TRL rollouts).
_LAUNCHED_EARLY = "_hf_zero3_passes_launched_early"


def passes_pending_at(step: int) -> bool:
    """DeepCompile's process-wide schedule still holds passes to launch at global step ``step``
    (``remaining_schedule``, a deque of ``(step, passes)``, its head the next to launch)."""
    pending = getattr(dc_backend, "remaining_schedule", None)
    return bool(pending) and pending[0][0] == step


def launch_pending_compile_passes(engine) -> bool:
    """Launch now the DeepCompile passes the engine's next training forward would launch first
    (those scheduled for its current global step, if still pending), so that Dynamo's reset comes
    before the functions a caller is about to compile, not after them; that forward then finds
    nothing to launch. The same launch DeepSpeed makes, with the same global step, at an earlier
    moment of the same step: every rank decides alike (same schedule, same step). True if it launched."""
    launch = getattr(engine, "launch_compile_passes", None)
    if launch is None or not deepcompile_active(engine):
        return False
    step = engine_global_steps(engine)
    if not passes_pending_at(step):
        return False
    launch(step)
    engine.__dict__[_LAUNCHED_EARLY] = step
    return True


def dc_gather_ops() -> dict:
    """DeepCompile's gather / wait / release ops (FX targets) by kind name."""
    dc = torch.ops.dc
    return {
        dc.allgather_param.default: "gather",
        dc.wait_allgather.default: "wait",
        dc.release_param.default: "release",
    }


def dc_prefetch_fused(graph_id: int, params: list, ids: list) -> None:
    torch.ops.dc.prefetch_params_fused(graph_id, params, ids)


def dc_prefetch_op():
    return torch.ops.dc.prefetch_params_fused.default


def profile_meta_defaults() -> dict:
    """The per-node metadata keys (with defaults) DeepCompile's profiler expects on every node."""
    return dict(graph_profile._PROFILE_META_DEFAULTS)


def profile_complete(prof, bwd: bool) -> bool:
    graph = prof.bwd_graph if bwd else prof.fwd_graph
    complete = prof.bwd_mem_complete if bwd else prof.fwd_mem_complete
    return graph is not None and complete and not graph_profile.is_profile_incomplete(graph)


def profile_fields(prof, bwd: bool) -> tuple[Any, list, list, list]:
    """(graph, mem, time, tensor sizes) of a DeepCompile ``ProfilingResult`` for one direction."""
    if bwd:
        return prof.bwd_graph, prof.bwd_mem, prof.bwd_time, prof.bwd_tensor_sizes
    return prof.fwd_graph, prof.fwd_mem, prof.fwd_time, prof.fwd_tensor_sizes


def patch_deepcompile_profile_in_allocator_units():
    """Works around DeepCompile's profile counting other processes' memory (no upstream issue
    found; deepspeed 0.19.8, ``deepspeed/compile/profilers/graph_profile.py``).

    The profilers add ``_get_mem_usage_out_of_torch()`` (NVML's used memory minus this allocator's
    reserve, read once per profiled graph: the CUDA context, NCCL, and every other process on the
    card) to each node's reading. A plan made from it, then checked against memory read later,
    depends on what the other processes held at the profiling instant: next to a job whose usage
    on the card changes, a plan that fits can be refused as not fitting.
    hf_zero3 plans in the caching allocator's own units (see :mod:`hf_zero3.compile.budget`), so
    the profile adds 0. Module global, read by name inside that module; returns the undo."""
    original = graph_profile._get_mem_usage_out_of_torch
    graph_profile._get_mem_usage_out_of_torch = lambda: 0

    def undo():
        graph_profile._get_mem_usage_out_of_torch = original

    return undo


def profile_all_peaks(prof) -> list[int]:
    return [m[3] for m in (prof.fwd_mem or [])] + [m[3] for m in (prof.bwd_mem or [])]


# --- DeepSpeed's rollout engine (deepspeed.runtime.rollout) ------------------------------------


def hybrid_rollout_module(rollout) -> nn.Module:
    return rollout.engine.module


def hybrid_rollout_tokenizer(rollout):
    return rollout.tokenizer
