"""How a call's decode steps run: :class:`GraphRunner` replays CUDA graphs of several steps each
between two stop agreements (on CPU, or with ``graph_steps=0``, steps one by one), and
:class:`StopSnapshot` gives a late stop check the previous check's flag without waiting for the GPU."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from .._upstream import torch as torch_up
from .caches import NO_GRAPHS
from .compiled import failure_reason
from .loop import DecodeLoop
from .phases import phase

log = logging.getLogger("hf_zero3.generation")

# steps per CUDA graph where the call does not say (LockstepConfig.graph_steps=None): a compiled
# step's graph of 8 replays as fast as 8 of one; an eager step (hundreds of launches) captures
# anew whenever a training step moved the cache's allocation, and graphs of one step capture one
# step instead of the 7- and 8-step windows (benchmarks/HISTORY.md, ablations)
GRAPH_STEPS, EAGER_GRAPH_STEPS = 8, 1


class GraphRunner:
    """Runs one call's decode steps. A loop's first step ever runs uncaptured (it compiles the
    forward, or with ``compile_step=False`` tunes its kernels, and it is the warm-up CUDA-graph
    capture needs; a real step, its token kept); on CUDA
    the rest replay CUDA graphs of ``graph_steps`` steps and of each shorter run between two stop
    agreements the calls meet (the first window after the prompt's token: at most
    ``graph_steps`` graphs, one memory pool), each captured once per loop and replayed by later calls while the
    parameters, the cache and the model's state are those they were captured with; on CPU, or
    with ``graph_steps=0``, steps run one by one."""

    def __init__(self, loop: DecodeLoop, graph_steps: int | None):
        self.loop = loop
        if graph_steps is None:  # an eager step's capture costs the host each launch of each step it captures
            graph_steps = EAGER_GRAPH_STEPS if loop.step_kind == "eager" else GRAPH_STEPS
        self.graph_steps = graph_steps if loop.mask.is_cuda and loop.model not in NO_GRAPHS and loop.compiled else 0
        self.capture_s = 0.0  # host seconds spent capturing this call's graphs
        self.captured: set[int] = set()
        self.reused = False  # replayed a graph an earlier call captured

    def _first(self) -> None:
        side = torch.cuda.Stream() if self.graph_steps else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.loop.step()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if not self.loop.compiled:
            self.graph_steps = 0  # a forward that did not compile may sync the host: no capture
        self.loop.warm = True

    def _capture(self, n: int) -> "torch.cuda.CUDAGraph":
        t = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        graphs = self.loop.graphs
        pool = next(iter(graphs.values())).pool() if graphs else None
        collecting = gc.isenabled()
        gc.disable()  # a collection inside the capture may free another graph, which invalidates it
        try:
            with torch_up.graph_capture(g, pool):
                for _ in range(n):
                    self.loop.step()
        finally:
            if collecting:
                gc.enable()
        self.capture_s += time.perf_counter() - t
        graphs[n] = g
        self.captured.add(n)
        return g

    def run(self, n: int) -> None:
        """``n`` decode steps; each phase is a profiler range (:mod:`.phases`) opened outside any
        capture, so a captured graph holds none of them."""
        if n > 0 and not self.loop.warm:
            with phase("first_step"):
                self._first()
            n -= 1
        while n > 0:
            if not self.graph_steps:
                with phase("step"):
                    self.loop.step()
                n -= 1
                continue
            size = min(n, self.graph_steps)
            g = self.loop.graphs.get(size)
            if g is None:
                try:
                    with phase("capture"):
                        g = self._capture(size)
                except RuntimeError as exc:  # an op that syncs the host cannot be captured; nothing ran
                    NO_GRAPHS[self.loop.model] = failure_reason(exc)
                    log.warning(
                        "hf_zero3 lockstep: decode steps not captured as CUDA graphs: %s", NO_GRAPHS[self.loop.model]
                    )
                    log.debug("the capture's traceback", exc_info=True)
                    self.loop.graphs.clear()
                    self.graph_steps = 0
                    continue
            elif size not in self.captured:
                self.reused = True
            with phase("replay"):
                g.replay()
            n -= size


class StopSnapshot:
    """A late stop check's value (:func:`hf_zero3.generation.config.stop_schedule`): at each
    check, whether some row was unfinished at the previous check. The flag is copied to pinned
    host memory after the steps queued before a check and read at the next one, when those steps
    have long run (the GPU is decoding the steps queued after them): no check waits for the GPU."""

    def __init__(self, loop: DecodeLoop):
        self.loop = loop
        cuda = loop.unfinished.is_cuda
        self.host = torch.ones((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def previous(self) -> bool:
        """The previous check's flag (True at the first check), then this check's snapshot."""
        if self.event is not None:
            self.event.synchronize()
        seen = bool(self.host)
        self.host.copy_(self.loop.unfinished.any(), non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
        return seen
