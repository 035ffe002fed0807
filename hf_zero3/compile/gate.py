"""The run-time prefetch gate's Python face: its two graph ops, their agreement, its counters.

The planned graph carries, before its first prefetch, ``hf_zero3::agree_launch`` and then one
``hf_zero3::gated_prefetch`` per planned slot::

    launch = agree_launch(anchor, graph_id, ref_alloc, budget, bwd)  # once per graph launch
    gated_prefetch(graph_id, params, ds_ids, nbytes, window_peak, launch)

``agree_launch`` measures this rank's drift (allocated memory now, minus what the profile had at
that point) and takes the group's maximum with one all-reduce,
so ``launch = [drift, budget]`` is identical on every rank (``budget``: the planned one as the
memory plan's calibration adjusts it, :func:`launch_budget`, from agreed values only). The
all-reduce runs on the host (a gloo mirror of the gather group, :func:`host_group`), so it never
waits for queued GPU work. ``gated_prefetch`` then issues
DeepCompile's fused all-gather only when ``window_peak + drift <= budget``: a pure function of
agreed values, so every rank issues or defers the same prefetches and the NCCL all-gathers keep
one order. A deferred gather happens at its point of use (DeepCompile's ``allgather_param``).

``gated_prefetch`` and the allocator read are native (``csrc/gate.cpp``) when
:func:`hf_zero3.native_gate.is_available`, else the pure-PyTorch code below, which decides the same.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import agree as agreement
from .. import native_gate
from .._upstream.deepspeed import dc_prefetch_fused
from .._upstream.torch import mark_side_effectful
from ..device_memory import MemoryState, read_cuda_memory

_LOCK = threading.Lock()
_LIB = None
_GROUPS: dict[int, object] = {}  # graph_id -> gather process group
_STATE_FNS: dict[int, Callable[[], "MemoryState"]] = {}  # graph_id -> memory reader (CPU tests)
# (graph_id, bwd) -> (calibration cap or None, tighten): set from agreed calibration results only
# (hf_zero3.compile.calibration), so every rank's launch carries the same budget.
_ADJUST: dict[tuple[int, bool], tuple[int | None, int]] = {}
_DRIFTS: dict[tuple[int, bool], int] = {}  # (graph_id, bwd) -> largest agreed drift since reset_drifts()


def _dc_prefetch(graph_id: int, params: list, ids: list) -> None:
    dc_prefetch_fused(graph_id, params, ids)


_ISSUE: list[Callable] = [_dc_prefetch]  # what the PyTorch fallback does to issue a prefetch
_COUNTERS = {"issued": 0, "deferred": 0, "issued_bytes": 0, "deferred_bytes": 0, "launches": 0}


def native():
    return native_gate.load()


def memory_state(device: int | torch.device | None = None) -> MemoryState:
    """Read natively when the gate is built, else through torch.cuda (same numbers)."""
    if device is None:
        device = torch.cuda.current_device()
    index = device.index if isinstance(device, torch.device) else int(device)
    mod = native()
    if mod is not None and mod.built_with_cuda():
        torch.cuda.init()  # the allocator has no device state before CUDA is initialised
        a, r, f, t, ppm = mod.memory_state(index)
        return MemoryState(a, r, f, t, ppm / 1e6)
    return read_cuda_memory(index)


def decide(window_peak: int, launch: Sequence[int]) -> bool:
    """Issue a planned prefetch under this launch's agreed ``[drift, budget]``?"""
    return int(window_peak) + int(launch[0]) <= int(launch[1])


def agree_drift(local_drift: int, group=None) -> int:
    """The group's largest drift: one tagged agreement, the only collective the gate adds per launch
    (over the gather group's gloo mirror, :func:`hf_zero3.agree.host_group`)."""
    return agreement.all_max([int(local_drift)], group, agreement.Tag("gate.launch"))[0]


def host_group(group):
    """The gloo mirror agreements run over (see :func:`hf_zero3.agree.host_group`)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return group
    return agreement.host_group(group)


def set_launch_group(graph_id: int, group, state_fn: Callable[[], "MemoryState"] | None = None) -> None:
    """Which group ``graph_id``'s launches agree over (through :func:`host_group`); ``state_fn``
    reads memory where the anchor is not a CUDA tensor (CPU tests drive the gate with it)."""
    _GROUPS[graph_id] = host_group(group)
    if state_fn is not None:
        _STATE_FNS[graph_id] = state_fn


def set_issue_fn(fn: Callable | None) -> None:
    """Replace what the PyTorch fallback calls to issue a prefetch (None: DeepCompile's fused
    all-gather). CPU tests issue a real gloo collective instead, so a disagreement would hang."""
    _ISSUE[0] = fn or _dc_prefetch


def local_drift(graph_id: int, ref_alloc: int, state: MemoryState) -> int:
    """Allocated memory now minus the profile's at the same point (the allocator's units, as the
    plan's): optimizer states allocated since, other graphs' leftovers."""
    return state.allocated - int(ref_alloc)


def _agree_launch_impl(anchor: torch.Tensor, graph_id: int, ref_alloc: int, budget: int, bwd: int = 0) -> torch.Tensor:
    if anchor.is_cuda:
        state = memory_state(anchor.device)
    elif graph_id in _STATE_FNS:
        state = _STATE_FNS[graph_id]()
    else:
        state = MemoryState(int(ref_alloc), 0, 0, 0)
    drift = agree_drift(local_drift(graph_id, ref_alloc, state), _GROUPS.get(graph_id))
    key = (int(graph_id), bool(bwd))
    _DRIFTS[key] = max(_DRIFTS.get(key, drift), drift)
    mod = native()
    if mod is not None:
        mod.note_launch()
    else:
        _COUNTERS["launches"] += 1
    return torch.tensor([drift, launch_budget(key, int(budget), drift)], dtype=torch.int64)


def launch_budget(key: tuple[int, bool], budget: int, drift: int) -> int:
    """The budget this launch's prefetches are gated against: the planned one, lowered by the
    calibration's ``tighten``, and while calibrating no higher than the graph's own profiled peak
    (``cap``) plus the drift, so prefetches never raise the step's peak (match_zero3's level)."""
    cap, tighten = _ADJUST.get(key, (None, 0))
    b = int(budget) - int(tighten)
    if cap is not None:
        b = min(b, int(cap) + int(drift))
    return b


def set_adjust(key: tuple[int, bool], cap: int | None, tighten: int) -> None:
    """Set graph ``key`` = (graph_id, bwd)'s calibration cap and tightening (agreed values only)."""
    _ADJUST[(int(key[0]), bool(key[1]))] = (None if cap is None else int(cap), int(tighten))


def drifts() -> dict:
    """The largest agreed drift of each graph's launches since :func:`reset_drifts`."""
    return dict(_DRIFTS)


def reset_drifts() -> None:
    _DRIFTS.clear()


def _gated_prefetch_impl(
    graph_id: int, params: list[torch.Tensor], ids: list[int], nbytes: int, window_peak: int, launch: torch.Tensor
) -> None:
    # A launch without data (DeepCompile's profiler may run the graph on meta values) defers.
    ok = launch.device.type != "meta" and launch.numel() == 2 and decide(window_peak, launch.tolist())
    if ok:
        _ISSUE[0](graph_id, params, ids)
        _COUNTERS["issued"] += 1
        _COUNTERS["issued_bytes"] += int(nbytes)
    else:
        _COUNTERS["deferred"] += 1
        _COUNTERS["deferred_bytes"] += int(nbytes)


def register_ops() -> None:
    """Define ``hf_zero3::agree_launch`` (always Python: it runs a collective) and, when the
    native gate is not built, ``hf_zero3::gated_prefetch`` in PyTorch. Idempotent."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return
        native()  # the native library must define its op first, if at all
        lib = torch.library.Library("hf_zero3", "FRAGMENT")
        lib.define("agree_launch(Tensor anchor, int graph_id, int ref_alloc, int budget, int bwd=0) -> Tensor")
        lib.impl("agree_launch", _agree_launch_impl, "CompositeExplicitAutograd")
        torch.library.register_fake("hf_zero3::agree_launch", _agree_launch_fake, lib=lib)
        if not hasattr(torch.ops.hf_zero3, "gated_prefetch"):
            lib.define(
                "gated_prefetch(int graph_id, Tensor[] params, int[] ids, int nbytes, int window_peak, "
                "Tensor launch) -> ()"
            )
            lib.impl("gated_prefetch", _gated_prefetch_impl, "CompositeExplicitAutograd")
            lib.impl("gated_prefetch", lambda *a: None, "Meta")
        # Nothing consumes gated_prefetch's (absent) output: keep FX's and inductor's dead-code
        # elimination from dropping it (both consult _side_effectful_functions).
        for name in ("agree_launch", "gated_prefetch"):
            mark_side_effectful(getattr(torch.ops.hf_zero3, name).default)
        _LIB = lib


def _agree_launch_fake(anchor, graph_id, ref_alloc, budget, bwd=0):
    return torch.empty(2, dtype=torch.int64, device="cpu")


def counters() -> dict:
    """Prefetches issued and deferred (and their bytes) and launches agreed, in this process."""
    mod = native()
    return dict(mod.counters()) if mod is not None else dict(_COUNTERS)


def reset_counters() -> None:
    mod = native()
    if mod is not None:
        mod.reset_counters()
    for k in _COUNTERS:
        _COUNTERS[k] = 0
