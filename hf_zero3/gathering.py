"""Make forwards outside the training step see gathered parameters, the same way on every rank.

Two strategies, chosen once per region and agreed across the gather group:

* ``"all"``: all-gather the whole model once (``GatheredParameters``), take DeepSpeed's eager
  per-layer hooks off meanwhile, and release everything on exit. No collective runs inside the
  region, so it costs one gather per region instead of one per layer per forward.
* ``"layerwise"``: gather each module's own parameters just before it runs and release them right
  after. Under plain ZeRO-3 DeepSpeed's hooks already do this; under DeepCompile those hooks are
  gone, so hf_zero3 installs its own for the region.

Under DeepCompile the in-place compiled ``__call__`` is bypassed for the region (its graph expects
partitioned parameters and would gather them natively a second time).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from . import agree, zero3

__all__ = ["GatherPlan", "gathered_forwards", "active_plan", "free_bytes", "GATHER_MODES",
           "eval_forward", "open_eval_region", "close_eval_region", "EvalGatherMixin"]

_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, GatherPlan]" = weakref.WeakKeyDictionary()


def active_plan(model_or_engine) -> "GatherPlan | None":
    """The plan of the gathered region open on this model, if any."""
    return _ACTIVE.get(zero3.unwrap(model_or_engine))

GATHER_MODES = ("auto", "all", "layerwise")
_MODE_CODE = {m: i for i, m in enumerate(GATHER_MODES)}
#: Headroom kept free on top of the gathered model (activations, KV cache, allocator slack).
HEADROOM_FRACTION = 0.10
HEADROOM_MIN_BYTES = 256 << 20


@dataclass
class GatherPlan:
    """What a region decided: ``strategy`` is "all", "layerwise" or "none" (not ZeRO-3)."""

    strategy: str
    need_bytes: int = 0
    min_free_bytes: int = 0
    deepcompile: bool = False


def free_bytes(device: torch.device) -> int:
    """Memory this process can still allocate on ``device``.

    On CUDA: the smaller of the device's free memory and what is left under the process's
    memory fraction cap (``torch.cuda.set_per_process_memory_fraction``); memory cached by the
    caching allocator but unused counts as free (:attr:`MemoryState.allocatable`). On CPU:
    available system memory.
    """
    if device.type == "cuda":
        from .device_memory import read_cuda_memory

        return read_cuda_memory(device).allocatable
    import psutil

    return int(psutil.virtual_memory().available)


def _decide(model: nn.Module, mode: str, group) -> GatherPlan:
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, not {mode!r}")
    dc = zero3.deepcompile_active(model)
    need = zero3.full_param_bytes(model)
    free = free_bytes(zero3.device_of(model))
    need_with_headroom = need + max(int(need * HEADROOM_FRACTION), HEADROOM_MIN_BYTES)
    fits = int(free >= need_with_headroom)
    code = _MODE_CODE[mode]
    # one all-reduce: [mode, -mode, -fits] -> max(mode), min(mode), min(fits); free min for reports
    mx = agree.all_max([code, -code, -fits, -free], group)
    if mx[0] != -mx[1]:
        raise ValueError(
            "ranks of the gather group asked for different gather modes "
            f"({GATHER_MODES[-mx[1]]!r} vs {GATHER_MODES[mx[0]]!r}); pass the same gather= on every rank")
    all_fit = -mx[2] == 1
    if mode == "all" or (mode == "auto" and all_fit):
        strategy = "all"
    else:
        strategy = "layerwise"
    return GatherPlan(strategy, need_bytes=need, min_free_bytes=-mx[3], deepcompile=dc)


@contextlib.contextmanager
def gathered_forwards(model_or_engine, mode: str = "auto", group=None,
                      layer_hooks: str = "auto") -> Iterator[GatherPlan]:
    """Within the block, forwards of the model see full parameters on every rank.

    Collective: every rank of the model's gather group must enter it together. ``mode``:
    ``"auto"`` gathers the whole model if every rank has the memory (agreed), else layer-wise;
    ``"all"`` / ``"layerwise"`` force one. ``layer_hooks`` picks who fetches layer by layer:
    ``"auto"`` (DeepSpeed's hooks while they are live; hf_zero3's once DeepCompile removed them
    or when no engine ever added them),
    ``"deepspeed"`` or ``"hf_zero3"``. Outside ZeRO-3 it does nothing.
    """
    if layer_hooks not in ("auto", "deepspeed", "hf_zero3"):
        raise ValueError(f"layer_hooks must be 'auto', 'deepspeed' or 'hf_zero3', not {layer_hooks!r}")
    model = zero3.unwrap(model_or_engine)
    if not zero3.is_zero3_model(model):
        yield GatherPlan("none")
        return
    outer = _ACTIVE.get(model)
    if outer is not None:  # nested (generate inside an eval loop): the outer region serves
        yield outer
        return
    if group is None:
        group = zero3.gather_group(model)
    plan = _decide(model_or_engine, mode, group)
    _ACTIVE[model] = plan
    with contextlib.ExitStack() as stack:
        stack.callback(_ACTIVE.pop, model, None)
        if plan.deepcompile:
            stack.enter_context(compiled_calls_bypassed(model))
        if plan.strategy == "all":
            import deepspeed

            params = zero3.zero3_params(model)
            stack.enter_context(deepspeed.zero.GatheredParameters(params, modifier_rank=None))
            stack.enter_context(zero3.zero3_hooks_suspended(model_or_engine))
        elif layer_hooks == "hf_zero3" or (layer_hooks == "auto" and not _deepspeed_hooks_live(
                model_or_engine, plan)):
            # DeepCompile removed DeepSpeed's hooks (or no engine ever added them, as for a
            # model built under zero.Init alone): fetch layer by layer ourselves.
            stack.enter_context(zero3.zero3_hooks_suspended(model_or_engine))
            stack.enter_context(layerwise_gather_hooks(model))
        yield plan


def _deepspeed_hooks_live(model_or_engine, plan: GatherPlan) -> bool:
    return not plan.deepcompile and zero3.offload_of(model_or_engine) is not None


@contextlib.contextmanager
def compiled_calls_bypassed(model: nn.Module):
    """Run ``model`` (and any regionally compiled submodule) eagerly for the duration."""
    saved = []
    for m in model.modules():
        impl = getattr(m, "_compiled_call_impl", None)
        if impl is not None:
            saved.append((m, impl))
            m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in saved:
            m._compiled_call_impl = impl


@contextlib.contextmanager
def layerwise_gather_hooks(model: nn.Module):
    """Our own eager ZeRO-3 fetch/release: each module gathers its direct parameters before its
    forward and partitions them after. Every rank runs the same forwards, so the all-gathers come
    in the same order on all of them."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    handles = []

    def params_of(module):
        return [p for p in module.parameters(recurse=False) if zero3.is_zero3_param(p)]

    def pre(module, args):
        ps = [p for p in params_of(module) if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if ps:
            ps[0].all_gather(param_list=ps)
        module._hf_zero3_depth = getattr(module, "_hf_zero3_depth", 0) + 1

    def post(module, args, output):
        module._hf_zero3_depth -= 1
        if module._hf_zero3_depth == 0:
            ps = [p for p in params_of(module) if p.ds_status == ZeroParamStatus.AVAILABLE]
            if ps:
                ps[0].partition(param_list=ps, has_been_updated=False)

    for m in model.modules():
        if params_of(m):
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
    with gathered_forwards(model_or_engine, gather, group) as plan:
        yield plan


def open_eval_region(model, gather: str = "auto") -> GatherPlan | None:
    """Open an eval region that stays open until :func:`close_eval_region` (Trainer eval loops,
    which have no "evaluation begins" event: the first eval forward opens it)."""
    model = zero3.unwrap(model)
    if active_plan(model) is not None:
        return active_plan(model)
    stack = contextlib.ExitStack()
    plan = stack.enter_context(eval_forward(model, gather))
    model._hf_zero3_eval_region = stack
    model.hf_zero3_last_eval_plan = plan
    return plan


def close_eval_region(model) -> bool:
    """Release what :func:`open_eval_region` gathered; True if a region was open. Local only."""
    model = zero3.unwrap(model)
    stack = model.__dict__.pop("_hf_zero3_eval_region", None)
    if stack is None:
        return False
    stack.close()
    return True


class EvalGatherMixin:
    """Model-class refinement: eval forwards of a ZeRO-3 model gather parameters when needed.

    * A training forward (``train()`` mode with grad enabled) first closes any open eval region.
    * With ``hf_zero3_eval_auto_region`` set (by :class:`~hf_zero3.Zero3Safe`), the first eval
      forward opens a region that stays open for the rest of the eval loop.
    * Otherwise an eval forward of a compiled ZeRO-3 model (DeepCompile) gets a region of its own.
    """

    hf_zero3_eval_auto_region: bool = False
    hf_zero3_eval_gather: str = "auto"

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or "_hf_zero3_in_call" in self.__dict__:
            return super().__call__(*args, **kwargs)
        training = self.training and torch.is_grad_enabled()
        if training:
            close_eval_region(self)
            return super().__call__(*args, **kwargs)
        if active_plan(self) is not None or not zero3.is_zero3_model(self):
            return super().__call__(*args, **kwargs)
        if self.hf_zero3_eval_auto_region:
            open_eval_region(self, self.hf_zero3_eval_gather)
            return super().__call__(*args, **kwargs)
        if getattr(self, "_compiled_call_impl", None) is not None:
            self.__dict__["_hf_zero3_in_call"] = True
            try:
                with eval_forward(self, self.hf_zero3_eval_gather):
                    return super().__call__(*args, **kwargs)
            finally:
                self.__dict__.pop("_hf_zero3_in_call", None)
        return super().__call__(*args, **kwargs)
