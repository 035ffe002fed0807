"""The DeepCompile pass that replaces ``prefetch`` + ``selective_gather`` with one budgeted plan.

Per graph (forward and backward), after DeepSpeed's ``zero3_compile`` pass has inserted the
all-gathers and releases and DeepCompile has profiled the result:

1. the profile is agreed across the gather group (:func:`.profile.agree_profile`) and so is the
   budget (:func:`.budget.agree_budget`), so every rank plans from identical inputs;
2. :func:`.planner.plan_prefetch` places fused prefetches under the budget; the plan's fingerprint
   is checked equal on all ranks (a mismatch raises rather than reordering NCCL all-gathers)
   (:mod:`.graph_plan`);
3. the graph gets one ``hf_zero3::agree_launch`` and one ``hf_zero3::gated_prefetch`` per slot
   (:mod:`.gate_control`);
4. the plan is then calibrated on real steps (:mod:`.calibration`): prefetches stay at
   ``match_zero3``'s level for ``calibrate_steps`` steps, whose agreed real peak sets how far the
   gate may go and which parameters become persistent (by benefit per byte within what is left);
   every later step's agreed peak keeps the gate below the budget. With ``calibrate_steps=0`` the
   profile is trusted: persistence is chosen on the last backward graph at compile time.

:class:`MemoryPlanPass` holds one engine's plans and hands each of these steps to its module;
:mod:`.report` logs and summarises them.

Entry points: :func:`compile_with_memory_plan` (a bare engine: register the pass, compile),
:func:`apply_memory_plan` (register the pass, return the schedule for ``engine.compile``),
:func:`memory_plan_schedule` (the schedule alone); accelerate's wrappers
(:mod:`hf_zero3.accelerate.plugin`) call :func:`apply_memory_plan` where :func:`plan_applies`
to the settings :func:`engine_plan_config` reads.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .._upstream import patches
from .._upstream.deepspeed import (
    accumulation_boundary,
    deepcompile_enabled,
    deepcompile_supported,
    engine_is_compiled,
    engine_zero_stage,
    gather_release_contract,
    graph_param_ids,
    patch_deepcompile_profile_in_allocator_units,
    pending_optimizer_bytes,
    register_compile_pass,
    replace_pending_schedule,
)
from .._upstream.torch import real_tensors
from .._upstream.versions import require
from ..agree import Tag, agree
from ..errors import Zero3Error
from ..runtime import runtime_of
from . import report
from .budget import MemoryBudget, agree_budget, compute_budget
from .calibration import Calibration, Decision
from .config import ConfigError, MemoryPlanConfig
from .gate import memory_state, register_ops
from .gate_control import rewrite, set_gates
from .graph_plan import (
    PlanRecord,
    agreed_profile,
    choose_persistent,
    gathered_params,
    is_last_backward,
    persist,
    persists_at_compile,
    plan_graph,
)

log = logging.getLogger("hf_zero3.memory_plan")
PASS_NAME = "hf_zero3_memory_plan"
ZERO3_PASS = "zero3_compile"


def pass_contract():
    # Reorders zero3_compile's all-gathers and sets persistence, as prefetch + selective_gather do.
    return gather_release_contract(frozenset({"prefetch", "selective_gather"}))


def memory_plan_schedule(config: MemoryPlanConfig) -> list:
    """DeepCompile schedule: the plan at ``plan_step`` (0: the only compile)."""
    if config.plan_step == 0:
        return [(0, [ZERO3_PASS, PASS_NAME])]
    return [(0, [ZERO3_PASS]), (config.plan_step, [ZERO3_PASS, PASS_NAME])]


@dataclass
class MemoryPlanPass:
    """The pass DeepCompile calls once per graph; holds this compile cycle's plans, shares one
    planning failure with every rank, and hands planning, calibration, gates and reports each to
    its module."""

    config: MemoryPlanConfig
    engine: object = None
    runtime: object = None  # whose gather group the agreements use (default: the engine's runtime)
    # Seams for CPU tests, which drive the pass on recorded graphs without CUDA or DeepCompile:
    ops: dict | None = None  # FX target -> node kind (default: DeepCompile's dc ops)
    read_memory: Callable | None = None  # () -> MemoryState (default: this CUDA device)
    persist_fn: Callable | None = None  # ds_id -> None (default: DeepCompile's set_persistent)
    read_peaks: Callable | None = None  # () -> (fwd/bwd, step, reserved peak), allocator bytes (default: CUDA's)
    records: dict = field(default_factory=dict)  # (graph_id, bwd) -> PlanRecord
    persistent: tuple = ()
    persistent_bytes: int = 0
    error: Exception | None = None
    calibration: Calibration | None = None

    def __post_init__(self):
        if self.calibration is None:
            self.calibration = Calibration(self.config.calibrate_steps)

    def memory(self):
        return (self.read_memory or memory_state)()

    def group(self, prof):
        """The engine's own gather group (its runtime's); the profile's only for a pass bound to none."""
        rt = self.runtime
        if rt is None and self.engine is not None:
            rt = runtime_of(self.engine)
        return rt.group if rt is not None else getattr(prof, "process_group", None)

    def budget(self, group) -> MemoryBudget:
        reserved = pending_optimizer_bytes(self.engine) if self.engine is not None else 0
        return agree_budget(compute_budget(self.config, self.memory(), reserved), group)

    def __call__(self, gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
        # Dynamo turns a backend exception into a graph break (and a confusing failure later), so
        # a plan error leaves this graph unplanned and is raised by the engine's next forward.
        # Everything that can fail on one rank (planning, its agreements, choosing persistence)
        # runs before the graph is touched, and its outcome is agreed: a failure on any rank
        # leaves the graph unplanned on every rank.
        self.calibration.planned_since_step = True  # this step's peak includes compiling and profiling
        with real_tensors():  # the agreements below are real collectives
            try:
                prepared, error = self._prepare(graph_id, graph_order, profiling_results, bwd), None
            except Exception as exc:  # noqa: BLE001 - shared, then re-raised from the next forward
                prepared, error = None, exc
            try:
                if isinstance(error, Zero3Error):
                    raise error  # an agreement inside planning shared it with every rank already
                agree(
                    Tag("memory_plan.graph", {"bwd": bool(bwd)}), self.group(profiling_results[graph_id]), error=error
                )
            except Exception as exc:  # noqa: BLE001
                log.error("hf_zero3 memory plan failed: %s", exc)
                self.error = self.error or exc
                self.records.pop((graph_id, bwd), None)
                return None
        if prepared is None:
            return None
        return self._apply(gm, graph_id, bwd, *prepared)

    def _prepare(self, graph_id, graph_order, profiling_results, bwd):
        """Plan the graph (agreed profile, budget and plan) and, on the last backward graph, choose
        the persistent parameters; None for a graph DeepCompile could not profile. Touches no graph."""
        prof = profiling_results[graph_id]
        group = self.group(prof)
        profile = agreed_profile(prof, graph_id, bwd, group, self.ops)
        if profile is None:
            return None
        budget = self.budget(group)
        record = self.records[(graph_id, bwd)] = plan_graph(profile, budget, self.config, group)
        chosen = None
        if bwd and persists_at_compile(self.config) and is_last_backward(graph_id, graph_order):
            chosen = choose_persistent(self.records, profiling_results, group, budget, self.memory())
        return record, group, chosen

    def _apply(self, gm, graph_id, bwd, record: PlanRecord, group, chosen):
        rewrite(
            gm,
            record.profile,
            record.plan,
            graph_id,
            record.budget.gate_budget,
            gate=self.config.gate,
            group=group,
            bwd=bwd,
        )
        if self.config.gate:
            self._set_gates()
        report.planned(graph_id, bwd, record)
        if chosen is not None:
            try:  # gm is rewritten already: hand it back whatever happens here
                self._persist(*chosen, group)
            except Exception as exc:  # noqa: BLE001 - re-raised from the next forward
                log.error("hf_zero3 memory plan: persistence failed: %s", exc)
                self.error = self.error or exc
        return gm

    def _persist(self, chosen: tuple, size_of: dict, group=None) -> None:
        nbytes = persist(chosen, size_of, group, self.memory, self.persist_fn)
        if nbytes is not None:
            self.persistent, self.persistent_bytes = chosen, nbytes

    def _set_gates(self) -> None:
        set_gates(self.records, self.calibration, self.config.mode)

    # --- calibration (see .calibration) ----------------------------------------------------------

    def _cuda_peaks(self) -> bool:
        """The step's peaks are read from (and reset in) CUDA's statistics."""
        return self.read_peaks is None and torch.cuda.is_available()

    def before_forward(self) -> None:
        """The first training forward after an optimizer step: restart the peak the coming step
        (all its micro-batches) is measured by."""
        self.calibration.before_forward(bool(self.records), self._cuda_peaks())

    def peak_now(self) -> int:
        """This rank's allocated peak since :meth:`before_forward`."""
        return self.peaks_now()[0]

    def peaks_now(self) -> tuple[int, int]:
        """(allocated, reserved) peaks since :meth:`before_forward`, in the allocator's units."""
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def _read_peaks(self, peak_fwd_bwd, peak_step, peak_reserved) -> tuple:
        """(forward/backward, step, reserved) peaks: those given, else :attr:`read_peaks`' or CUDA's."""
        if peak_step is not None:
            return peak_fwd_bwd, peak_step, peak_reserved
        if self.read_peaks is not None:
            return self.read_peaks()
        peak_step, peak_reserved = self.peaks_now()
        return (peak_step if peak_fwd_bwd is None else peak_fwd_bwd), peak_step, peak_reserved

    def after_step(
        self,
        peak_fwd_bwd: int | None = None,
        peak_step: int | None = None,
        peak_reserved: int | None = None,
        *,
        boundary: bool = True,
        error: BaseException | None = None,
    ) -> Decision | None:
        """``engine.step`` returned (or raised ``error``, shared here with every rank): the
        calibration agrees the step's peaks and calibrates or watches; the gates and persistent
        parameters follow what it decided. ``peak_*`` default to :attr:`read_peaks` / CUDA's.
        Returns the calibration's decision on the step that made it."""
        if not self.records:  # agreed: a graph is recorded only when every rank planned it
            if error is not None:
                raise error
            return None
        cal, group = self.calibration, self.group(None)
        gates = (cal.decision, cal.tighten)
        decision = cal.after_step(
            self.records,
            group,
            lambda: self._read_peaks(peak_fwd_bwd, peak_step, peak_reserved),
            gate=self.config.gate,
            persist=self.config.persist and self.config.mode == "budget",
            boundary=boundary,
            error=error,
            device=self._cuda_peaks(),
        )
        if (cal.decision, cal.tighten) != gates:
            self._set_gates()
        if decision is not None and decision.persistent:
            self._persist(decision.persistent, gathered_params(self.records)[1], group)
        return decision

    def summary(self) -> dict:
        return report.summary(self.records, self.persistent, self.persistent_bytes, self.calibration)


class _Dispatcher:
    """The one callable registered under :data:`PASS_NAME`.

    DeepCompile's pass table and schedule are process-wide (DeepSpeed 0.19.8): a second engine's
    ``compile`` replaces the first one's schedule, so a pass bound to one engine would plan another
    engine's graphs (a TRL reference or teacher model). This dispatcher hands each graph to the plan
    of the engine whose parameters the graph takes (DeepSpeed parameter ids are process-unique).
    """

    def __init__(self):
        self._plans: list = []  # weak references to MemoryPlanPass objects

    def others(self, planner: "MemoryPlanPass") -> list:
        """Live plans of other engines."""
        return [
            p
            for p in (r() for r in self._plans)
            if p is not None and p is not planner and p.engine is not planner.engine
        ]

    def add(self, planner: "MemoryPlanPass") -> None:
        self._plans = [r for r in self._plans if r() is not None and r() is not planner] + [weakref.ref(planner)]

    def route(self, param_manager, graph_id) -> "MemoryPlanPass | None":
        plans = [p for p in (r() for r in self._plans) if p is not None]
        ids = graph_param_ids(param_manager, graph_id) if param_manager is not None else set()
        if ids:
            owners = [p for p in plans if p.engine is not None and ids <= runtime_of(p.engine).param_ids()]
            if len(owners) == 1:
                return owners[0]
        return plans[0] if len(plans) == 1 and not ids else None

    def __call__(self, gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
        planner = self.route(param_manager, graph_id)
        if planner is None:
            log.error(
                "hf_zero3 memory plan: graph %s belongs to no engine with a memory plan; left unplanned", graph_id
            )
            return None
        return planner(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)


_DISPATCHER = _Dispatcher()


def bind_memory_plan_config(engine, config: MemoryPlanConfig) -> None:
    """The settings accelerate's prepare resolved for ``engine``, for its plan (local)."""
    runtime_of(engine).memory.config = config


def engine_plan_config(engine) -> MemoryPlanConfig:
    """The settings for ``engine``: what accelerate's prepare resolved (kept on its runtime), else its
    DeepSpeed config's ``hf_zero3.memory_plan`` section (and ``HF_ZERO3_*``)."""
    config = runtime_of(engine).memory.config
    if config is None:
        raw = getattr(engine, "config", None)
        config = MemoryPlanConfig.from_ds_config(raw if isinstance(raw, dict) else {})
    return config


def plan_applies(engine, config: MemoryPlanConfig) -> bool:
    """The plan is on and the engine is a ZeRO-3 DeepCompile engine."""
    return config.enabled and deepcompile_enabled(engine) and engine_zero_stage(engine) == 3


def apply_memory_plan(engine, config: MemoryPlanConfig | None = None) -> tuple[MemoryPlanPass, list]:
    """Bind a memory-plan pass to ``engine`` (its runtime keeps it); returns (pass, schedule for
    ``engine.compile``). Several engines in one process each keep their own plan."""
    require("core")
    config = config or engine_plan_config(engine)
    ok, why = deepcompile_supported()
    if not ok:
        raise ConfigError(f"hf_zero3 memory plan needs DeepCompile, which is unavailable: {why}")
    if not deepcompile_enabled(engine):
        raise ConfigError('the DeepSpeed config does not enable DeepCompile; add "compile": {"deepcompile": true}')
    if engine_zero_stage(engine) != 3:
        raise ConfigError(
            f"the memory plan schedules ZeRO-3 all-gathers; this engine runs ZeRO stage "
            f"{engine_zero_stage(engine)} (set zero_optimization.stage to 3)"
        )
    rt = runtime_of(engine)
    planner = MemoryPlanPass(config, engine, runtime=rt)
    register_compile_pass(PASS_NAME, _DISPATCHER, pass_contract())
    patches.install("deepcompile_profile_in_allocator_units", patch_deepcompile_profile_in_allocator_units)
    if _DISPATCHER.others(planner):
        log.warning(
            "hf_zero3: a second DeepCompile engine in this process. DeepSpeed 0.19.8 keeps one DeepCompile "
            "native state per process, owned by the engine compiled last: only that engine may run its "
            "compiled graph. Compile the engine you train last; evaluate the others through "
            "hf_zero3.eval_forward / Zero3Safe (eager, gathered). Each keeps its own memory plan."
        )
    _DISPATCHER.add(planner)
    register_ops()
    rt.memory.plan, rt.memory.config = planner, config
    _raise_plan_errors_from_forward(engine, rt)
    return planner, memory_plan_schedule(config)


def _raise_plan_errors_from_forward(engine, rt) -> None:
    """Wrap ``engine.forward`` (raise a plan error; a training forward restarts the peak the step is
    measured by) and ``engine.step`` (the step's peaks go to the calibration, agreed)."""
    if getattr(engine.forward, "_hf_zero3_checks_plan", False):
        return
    forward = engine.forward

    def checked_forward(*args, **kwargs):
        planner = rt.memory.plan
        if planner is not None and torch.is_grad_enabled():
            planner.before_forward()
        out = forward(*args, **kwargs)
        if planner is not None and planner.error is not None:
            raise planner.error
        return out

    checked_forward._hf_zero3_checks_plan = True
    engine.forward = checked_forward
    step = getattr(engine, "step", None)
    if step is None:
        return

    def measured_step(*args, **kwargs):
        planner = rt.memory.plan
        if planner is None:
            return step(*args, **kwargs)
        boundary = accumulation_boundary(engine)  # before step() advances it; equal on every rank
        before = planner.peak_now() if planner.records and planner.read_peaks is None and boundary else None
        try:
            out = step(*args, **kwargs)
        except Exception as exc:  # every rank raises it (they meet in this step's agreement)
            planner.after_step(boundary=boundary, error=exc)
            raise
        planner.after_step(before, None, boundary=boundary)
        return out

    measured_step._hf_zero3_measures_plan = True
    engine.step = measured_step


def compile_with_memory_plan(
    engine, config: MemoryPlanConfig | None = None, backend: str | None = None, compile_kwargs: dict | None = None
) -> MemoryPlanPass:
    """Register the pass and compile ``engine`` with its schedule. On an engine someone already
    compiled (accelerate) but that has not run a compiled step, the schedule is swapped in."""
    planner, schedule = apply_memory_plan(engine, config)
    if engine_is_compiled(engine):
        if not replace_pending_schedule(engine, schedule):
            raise ConfigError(
                "the engine was compiled and has already run compiled steps with another schedule; "
                "apply the memory plan before the first training step"
            )
    else:
        engine.compile(
            backend=backend or planner.config.compile_backend, compile_kwargs=compile_kwargs or {}, schedule=schedule
        )
    return planner
