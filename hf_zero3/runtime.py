"""One :class:`Runtime` per ZeRO-3 model (and its DeepSpeed engine): everything hf_zero3 keeps about it.

The runtime owns the model's gather group and the call counter its agreements are tagged with,
and one typed record per concern, each written by one module: :class:`GenerationState`
(lockstep's settings, the running call, the last ``generate()``'s report, also left on the
generating model as ``hf_zero3_last_generate``), :class:`EvalState` (the eval settings and the
gathered region open on the model), :class:`MemoryPlanState` and :class:`TrlState`. It is
attached explicitly, as the attribute ``hf_zero3_runtime`` on the engine, the module it wraps and
(for PEFT) the base model that generates, by whichever entry point first sees them (``lockstep``,
``eval_forward``, ``Zero3Safe``, the memory plan, the TRL adapter). Nothing is found by scanning
the heap: a bare module handed to ``deepspeed.initialize``
is served through the eager hooks DeepSpeed put on it (:mod:`hf_zero3._upstream.deepspeed`).

A deep-copied or pickled model does not take its runtime along (the copy gets its own on first use).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch.nn as nn

from . import agree, zero3
from ._upstream import deepspeed as ds_up
from ._upstream import torch as torch_up

if TYPE_CHECKING:  # annotations only: these modules import this one
    from .compile.config import MemoryPlanConfig
    from .compile.memory_plan import MemoryPlanPass
    from .gathering import GatherPlan, Region
    from .generation.call import LockstepCall
    from .generation.config import LockstepConfig, LockstepStats

ATTR = "hf_zero3_runtime"
_CREATE_LOCK = threading.Lock()


def _detached():
    return None


@dataclass
class GenerationState:
    """Lockstep generation on one model; written by :mod:`hf_zero3.generation.lockstep` alone."""

    config: LockstepConfig | None = None  # the model's lockstep settings (lockstep(), Zero3Safe)
    call: LockstepCall | None = None  # the generate() call running now
    last: LockstepStats | None = None  # the report of the last generate() call


@dataclass
class EvalState:
    """Eval forwards on one model; written by :mod:`hf_zero3.gathering` alone."""

    auto_region: bool = False  # the first eval forward opens a gathered region (Zero3Safe arms it)
    gather: str = "auto"  # that region's gathering
    region: Region | None = None  # the gathered region open on the model
    last_plan: GatherPlan | None = None  # the last eval region's plan


@dataclass
class MemoryPlanState:
    """The DeepCompile memory plan of one engine; written by :mod:`hf_zero3.compile.memory_plan` alone."""

    config: MemoryPlanConfig | None = None  # resolved when accelerate prepares the engine
    plan: MemoryPlanPass | None = None  # the pass bound to the engine


@dataclass
class TrlState:
    """The TRL trainer a model generates for; written by :mod:`hf_zero3.trainer.trl_adapter` alone."""

    trainer: str | None = None  # its class name (its rollouts decode through the static loop)
    join: Any = None  # call alignment: this rank only joins the others' calls (an op name)


class Runtime:
    """hf_zero3's state for one ZeRO-3 model; see the module docstring."""

    def __init__(self, model: nn.Module, engine=None):
        self._model = weakref.ref(model)
        self._engine = weakref.ref(engine) if engine is not None else None
        self._group: Any = None
        self.counter = 0  # call-level agreements so far (tags carry it)
        self.generation = GenerationState()
        self.eval = EvalState()
        self.memory = MemoryPlanState()
        self.trl = TrlState()
        self._busy = threading.Lock()  # one generate() at a time per model (threads queue)
        self._key: int | None = None

    # copies of a model (TRL reference models are deep copies) get their own runtime on first use
    def __reduce__(self):
        return (_detached, ())

    def __deepcopy__(self, memo):
        return None

    def __repr__(self) -> str:
        model = self.model
        return (
            f"Runtime({type(model).__name__ if model is not None else '<dead>'}, "
            f"engine={'yes' if self.engine is not None else 'no'}, calls={self.counter})"
        )

    # -- what the runtime serves --------------------------------------------------------------
    @property
    def model(self) -> nn.Module | None:
        return self._model()

    @property
    def engine(self):
        return self._engine() if self._engine is not None else None

    def attach_engine(self, engine) -> None:
        if engine is not None and self.engine is not engine:
            self._engine = weakref.ref(engine)
            engine.__dict__[ATTR] = self

    @property
    def group(self):
        """The process group the model's parameters are all-gathered over (see :func:`zero3.gather_group`)."""
        if self._group is None:
            self._group = zero3.gather_group(self.model)
        return self._group

    def offload(self):
        """The owner of the eager ZeRO-3 hooks (None once DeepCompile removed them, or without an engine)."""
        engine = self.engine
        if engine is not None:
            return ds_up.engine_offload(engine)
        return ds_up.offload_from_module_hooks(self.model)

    def deepcompile_active(self) -> bool:
        """The model's forward is DeepCompile's graph, which gathers parameters natively."""
        engine = self.engine
        if engine is not None:
            return ds_up.deepcompile_active(engine)
        model = self.model
        # a bare module of a compiled engine: compiled in place, no eager hooks left
        return torch_up.compiled_call(model) is not None and ds_up.offload_from_module_hooks(model) is None

    def param_ids(self) -> frozenset[int]:
        """DeepSpeed ids of the model's ZeRO-3 parameters (the memory-plan pass routes graphs by them)."""
        return frozenset(ds_up.param_id(p) for p in zero3.zero3_params(self.model))

    # -- tagged agreements --------------------------------------------------------------------
    def model_key(self) -> int:
        """Equal on every rank for the same model, different for two models of one process (policy
        and reference): the first DeepSpeed parameter id (a process-wide counter, advanced in the
        same order on every rank that builds the same models). Computed once."""
        if self._key is None:
            ids = self.param_ids()
            self._key = min(ids) if ids else -1
        return self._key

    def tag(self, op: str, *, count: bool = True, **options) -> agree.Tag:
        """The tag of this model's next agreement (``count``: a call-level one, numbered). The tag
        holds nothing a rank could know alone: options, the model, the count of collective calls."""
        if count:
            self.counter += 1
        return agree.Tag(op, {"model": self.model_key(), **options}, self.counter)

    def agree(
        self,
        op: str,
        values=(),
        *,
        error: BaseException | None = None,
        count: bool = True,
        record: bool | None = None,
        group=None,
        **options,
    ) -> list[int]:
        """A tagged agree-or-raise over ``group`` (default: this model's gather group), see
        :func:`hf_zero3.agree.agree`."""
        tag = self.tag(op, count=count, **options)
        return agree.agree(
            tag,
            group if group is not None else self.group,
            values,
            error=error,
            record=count if record is None else record,
        )

    # -- one generate() at a time -------------------------------------------------------------
    def enter(self) -> None:
        """Queue behind a generate() of this model running in another thread: each rank runs one call
        at a time, so calls pair up in order (two calls with the same options pair up whichever
        order each rank takes them in; different options raise a named divergence)."""
        self._busy.acquire()

    def leave(self) -> None:
        self._busy.release()


def _targets(obj) -> tuple[Any, list[nn.Module]]:
    """(engine or None, the modules the runtime is attached to: engine.module, PEFT base models)."""
    engine = obj if ds_up.is_engine(obj) else None
    module = ds_up.engine_module(engine) if engine is not None else obj
    chain = [module]
    get_base = getattr(module, "get_base_model", None)  # PEFT
    if callable(get_base):
        base = get_base()
        if base is not module:
            chain.append(base)
    return engine, chain


def runtime_of(obj, create: bool = True) -> Runtime | None:
    """The runtime of a model, PEFT model or DeepSpeed engine (attached on first use when ``create``)."""
    if obj is None:
        return None
    direct = obj.__dict__.get(ATTR) if hasattr(obj, "__dict__") else None
    if direct is not None and (not ds_up.is_engine(obj) or direct.engine is obj):
        return direct
    engine, chain = _targets(obj)
    with _CREATE_LOCK:
        rt = next((m.__dict__.get(ATTR) for m in chain if m.__dict__.get(ATTR) is not None), None)
        if rt is None:
            if not create:
                return None
            rt = Runtime(chain[0], engine)
        for m in chain:
            m.__dict__[ATTR] = rt
        if engine is not None:
            rt.attach_engine(engine)
    return rt


def unwrap(model_or_engine: Any) -> nn.Module:
    """The module inside a DeepSpeed engine (the module itself otherwise; PEFT models stay as they
    are: their forward is the one to call). Attaches the engine to the module's runtime."""
    if ds_up.is_engine(model_or_engine):
        runtime_of(model_or_engine)
        return ds_up.engine_module(model_or_engine)
    return model_or_engine


def engine_of(model_or_engine: Any):
    """The ``DeepSpeedEngine`` of this model, if an entry point was handed it (None otherwise)."""
    if ds_up.is_engine(model_or_engine):
        return model_or_engine
    rt = runtime_of(model_or_engine, create=False)
    return rt.engine if rt is not None else None


def deepcompile_active(model_or_engine) -> bool:
    """``engine.compile()`` has run with DeepCompile: the eager ZeRO-3 hooks are gone and the
    compiled graph gathers parameters natively."""
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
