"""Make forwards outside the training step see gathered parameters, the same way on every rank.

Three strategies, chosen once per region and agreed across the gather group (one tagged
agreement, so a rank that asks for another mode, or fails while deciding, makes every rank raise):

* ``"all"``: all-gather the whole model once (``GatheredParameters``), take DeepSpeed's eager
  per-layer hooks off meanwhile, and release everything on exit. No collective runs inside the
  region, so it costs one gather per region instead of one per layer per forward.
* ``"layerwise"``: gather each module's own parameters just before it runs and release them right
  after. Under plain ZeRO-3 DeepSpeed's hooks already do this; under DeepCompile those hooks are
  gone, so hf_zero3 installs its own for the region.
* ``"held"``: someone already holds every parameter gathered on every rank (TRL's
  ``unwrap_model_for_generation``); the region uses them as they are and gathers nothing.

Under DeepCompile the in-place compiled ``__call__`` is bypassed for the region (its graph expects
partitioned parameters and would gather them natively a second time). Whatever happens inside, a
region leaves on exit what it found: parameters partitioned, hooks restored, counters clean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import psutil
import torch
import torch.nn as nn

from . import runtime, zero3
from ._upstream import deepspeed as ds_up
from ._upstream import torch as torch_up
from ._upstream.versions import require
from .device_memory import read_cuda_memory
from .runtime import runtime_of

GATHER_MODES = ("auto", "all", "layerwise")
LAYER_HOOKS = ("auto", "deepspeed", "hf_zero3")
#: Headroom kept free on top of the gathered model (activations, KV cache, allocator slack).
HEADROOM_FRACTION = 0.10
HEADROOM_MIN_BYTES = 256 << 20


@dataclass
class GatherPlan:
    """What a region decided: ``strategy`` is "all", "layerwise", "held" or "none" (not ZeRO-3)."""

    strategy: str
    need_bytes: int = 0
    min_free_bytes: int = 0
    deepcompile: bool = False


@dataclass
class Region:
    plan: GatherPlan
    stack: contextlib.ExitStack | None = None  # set for regions that outlive one ``with`` (eval loops)


def active_plan(model_or_engine) -> "GatherPlan | None":
    """The plan of the gathered region open on this model, if any."""
    rt = runtime_of(model_or_engine, create=False)
    return rt.eval.region.plan if rt is not None and rt.eval.region is not None else None


def free_bytes(device: torch.device) -> int:
    """Memory this process can still allocate on ``device``.

    On CUDA: the smaller of the device's free memory and what is left under the process's
    memory fraction cap (``torch.cuda.set_per_process_memory_fraction``); memory cached by the
    caching allocator but unused counts as free (:attr:`MemoryState.allocatable`). On CPU:
    available system memory.
    """
    if device.type == "cuda":
        return read_cuda_memory(device).allocatable
    return int(psutil.virtual_memory().available)


def _local_facts(model: nn.Module, mode: str, layer_hooks: str) -> tuple[list[int], int]:
    """([-fits, held, -held, -free], bytes needed) on this rank; raises on a bad argument."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, not {mode!r}")
    if layer_hooks not in LAYER_HOOKS:
        raise ValueError(f"layer_hooks must be one of {LAYER_HOOKS}, not {layer_hooks!r}")
    params = zero3.zero3_params(model)
    need = zero3.full_param_bytes(model)
    free = free_bytes(zero3.device_of(model))
    fits = int(free >= need + max(int(need * HEADROOM_FRACTION), HEADROOM_MIN_BYTES))
    held = int(bool(params) and all(ds_up.param_available(p) for p in params))
    return [-fits, held, -held, -free], need


def region_facts(model: nn.Module, mode: str, layer_hooks: str = "auto") -> tuple[list[int], int, Exception | None]:
    """This rank's facts for a region's decision, to agree in another agreement that precedes the
    region (``gathered_forwards(..., agreed=...)``): (4 values, bytes needed, the local error)."""
    try:
        facts, need = _local_facts(model, mode, layer_hooks)
        return facts, need, None
    except Exception as exc:  # the caller shares it in its agreement: every rank raises it
        return [0, 0, 0, 0], 0, exc


def _decide(rt, model: nn.Module, mode: str, layer_hooks: str, op: str, group, agreed=None) -> GatherPlan:
    if agreed is not None:  # agreed already, in the agreement that opened the caller's operation
        (neg_fits_min, held_max, neg_held_min, neg_free_min), need = agreed
    else:
        facts, need, error = region_facts(model, mode, layer_hooks)
        # one agreement: the tag carries the mode (must match), the values who fits / who holds
        neg_fits_min, held_max, neg_held_min, neg_free_min = rt.agree(op, facts, error=error, group=group, gather=mode)
    if held_max != -neg_held_min:
        raise RuntimeError(
            "hf_zero3: the model's parameters are already gathered on some ranks of its group but not on "
            "others; a region cannot start from that state. Enter GatheredParameters (or TRL's "
            "unwrap_model_for_generation) on every rank, or on none."
        )
    if held_max:
        strategy = "held"
    elif mode == "all" or (mode == "auto" and -neg_fits_min == 1):
        strategy = "all"
    else:
        strategy = "layerwise"
    return GatherPlan(strategy, need_bytes=need, min_free_bytes=-neg_free_min, deepcompile=rt.deepcompile_active())


@contextlib.contextmanager
def gathered_forwards(
    model_or_engine, mode: str = "auto", group=None, layer_hooks: str = "auto", op: str = "region", agreed=None
) -> Iterator[GatherPlan]:
    """Within the block, forwards of the model see full parameters on every rank.

    Collective: every rank of the model's gather group must enter it together (one tagged
    agreement; ``op`` names it in errors). ``mode``: ``"auto"`` gathers the whole model if every
    rank has the memory (agreed), else layer-wise; ``"all"`` / ``"layerwise"`` force one; parameters
    someone already gathered on every rank are used as they are. ``layer_hooks`` picks who fetches
    layer by layer: ``"auto"`` (DeepSpeed's hooks while they are live; hf_zero3's once DeepCompile
    removed them or when no engine ever added them), ``"deepspeed"`` or ``"hf_zero3"``.
    Outside ZeRO-3 it does nothing. ``group`` overrides the parameters' own gather group.
    ``agreed``: the group's reduction of every rank's :func:`region_facts` values, with this rank's
    bytes needed, from an agreement the caller ran just before (a ``generate()`` call's first: one
    agreement fewer per call); the region then runs none of its own.
    """
    model = runtime.unwrap(model_or_engine)
    if not zero3.is_zero3_model(model):
        yield GatherPlan("none")
        return
    rt = runtime_of(model_or_engine)
    if rt.eval.region is not None:  # nested (generate inside an eval loop): the outer region serves
        yield rt.eval.region.plan
        return
    plan = _decide(rt, model, mode, layer_hooks, op, group, agreed)
    with contextlib.ExitStack() as stack:
        rt.eval.region = Region(plan)
        stack.callback(setattr, rt.eval, "region", None)
        if plan.deepcompile:
            stack.enter_context(compiled_calls_bypassed(model))
        if plan.strategy in ("all", "held"):
            if plan.strategy == "all":
                stack.enter_context(ds_up.gathered_parameters(zero3.zero3_params(model)))
            stack.enter_context(runtime.zero3_hooks_suspended(model_or_engine))
        elif layer_hooks == "hf_zero3" or (layer_hooks == "auto" and (plan.deepcompile or rt.offload() is None)):
            # DeepCompile removed DeepSpeed's hooks (or no engine ever added them, as for a
            # model built under zero.Init alone): fetch layer by layer ourselves.
            stack.enter_context(runtime.zero3_hooks_suspended(model_or_engine))
            stack.enter_context(layerwise_gather_hooks(model))
        yield plan


@contextlib.contextmanager
def compiled_calls_bypassed(model: nn.Module):
    """Run ``model`` (and any regionally compiled submodule) eagerly for the duration."""
    saved = []
    for m in model.modules():
        impl = torch_up.compiled_call(m)
        if impl is not None:
            saved.append((m, impl))
            torch_up.set_compiled_call(m, None)
    try:
        yield
    finally:
        for m, impl in saved:
            torch_up.set_compiled_call(m, impl)


@contextlib.contextmanager
def layerwise_gather_hooks(model: nn.Module):
    """Our own eager ZeRO-3 fetch/release: each module gathers its direct parameters before its
    forward and partitions them after, also when the forward raises (``always_call``). Every rank
    runs the same forwards, so the all-gathers come in the same order on all of them. On exit,
    anything still gathered is released and the depth counters are dropped."""
    handles, depth = [], {}
    owned = {m: [p for p in m.parameters(recurse=False) if zero3.is_zero3_param(p)] for m in model.modules()}
    owned = {m: ps for m, ps in owned.items() if ps}

    def pre(module, args):
        ds_up.gather_now(owned[module])
        depth[module] = depth.get(module, 0) + 1

    def post(module, args, output):
        depth[module] = depth.get(module, 1) - 1
        if depth[module] <= 0:
            depth.pop(module, None)
            ds_up.partition_now(owned[module])

    for m in owned:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for ps in owned.values():
            ds_up.partition_now(ps)
        depth.clear()


# -- eval forwards -------------------------------------------------------------------------------
# After ``engine.compile()`` with DeepCompile, DeepSpeed's eager hooks are gone and the model's
# in-place compiled ``__call__`` expects partitioned parameters that its graph gathers natively. A
# forward that leaves that graph (``eval()``/``no_grad`` recompiles, graph breaks, skipped Dynamo
# frames, Trainer evaluation through the bare module) sees 0-element weights. Such forwards run
# eagerly on gathered parameters here, and everything is partitioned again before training
# resumes, so the compiled training graph and DeepCompile's native state find what they left.


@contextlib.contextmanager
def eval_forward(model_or_engine, gather: str = "auto", group=None) -> Iterator[GatherPlan]:
    """Forwards inside the block see gathered parameters and run eagerly (no DeepCompile graph).

    Use it around any forward outside the training step that a Trainer does not run for you:
    custom eval loops, RL actors with a graph break before the HF model, reference-model scoring::

        with hf_zero3.eval_forward(engine):
            logits = engine.module(input_ids).logits

    Collective on entry (every rank of the gather group enters together). ``gather="auto"``
    gathers the whole model once if every rank has the memory, else layer by layer; in the
    layer-wise case every rank must then run the same forwards. Harmless without ZeRO-3.
    """
    require("core")
    with gathered_forwards(model_or_engine, gather, group, op="eval_forward") as plan:
        yield plan


def open_eval_region(model, gather: str = "auto") -> GatherPlan | None:
    """Open an eval region that stays open until :func:`close_eval_region` (Trainer eval loops,
    which have no "evaluation begins" event: the first eval forward opens it)."""
    rt = runtime_of(model)
    if rt.eval.region is not None:
        return rt.eval.region.plan
    stack = contextlib.ExitStack()
    plan = stack.enter_context(gathered_forwards(model, gather, op="eval_region"))
    if rt.eval.region is not None:  # ZeRO-3: keep the region (and its exit) on the runtime
        rt.eval.region.stack = stack
    rt.eval.last_plan = plan
    return plan


def arm_eval_region(model, gather: str) -> None:
    """The first eval forward of ``model`` opens a region of ``gather`` that stays open for the
    rest of the eval loop (:class:`EvalGatherMixin`; Zero3Safe arms it). Local."""
    rt = runtime_of(model)
    rt.eval.auto_region, rt.eval.gather = True, gather


def close_eval_region(model) -> bool:
    """Release what :func:`open_eval_region` gathered; True if a region was open. Local only."""
    rt = runtime_of(model, create=False)
    region = rt.eval.region if rt is not None else None
    if region is None or region.stack is None:
        return False
    region.stack.close()
    return True


class EvalGatherMixin:
    """Model-class refinement: eval forwards of a ZeRO-3 model gather parameters when needed.

    * A training forward (``train()`` mode with grad enabled) first closes any open eval region.
    * With the runtime's eval region armed (:func:`arm_eval_region`, by :class:`~hf_zero3.Zero3Safe`), the first
      eval forward opens a region that stays open for the rest of the eval loop.
    * Otherwise an eval forward of a compiled ZeRO-3 model (DeepCompile) gets a region of its own,
      released when the forward returns or raises.
    """

    @property
    def hf_zero3_last_eval_plan(self) -> GatherPlan | None:
        """The plan of the last eval region opened on this model."""
        rt = runtime_of(self, create=False)
        return rt.eval.last_plan if rt is not None else None

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or "_hf_zero3_in_call" in self.__dict__:
            return super().__call__(*args, **kwargs)
        rt = runtime_of(self)
        if self.training and torch.is_grad_enabled():
            close_eval_region(self)
            return super().__call__(*args, **kwargs)
        if rt.eval.region is not None or not zero3.is_zero3_model(self):
            return super().__call__(*args, **kwargs)
        if rt.eval.auto_region:
            open_eval_region(self, rt.eval.gather)
            return super().__call__(*args, **kwargs)
        if torch_up.compiled_call(self) is not None:
            self.__dict__["_hf_zero3_in_call"] = True
            try:
                with eval_forward(self, rt.eval.gather):
                    return super().__call__(*args, **kwargs)
            finally:
                self.__dict__.pop("_hf_zero3_in_call", None)
        return super().__call__(*args, **kwargs)
