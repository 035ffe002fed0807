"""The static loop's phases as profiler ranges: ``hf_zero3.<phase>`` in a ``torch.profiler``
trace, on the host and (for CUDA kernels launched inside) on the GPU, so a trace says where a
call's time goes without patching the loop (benchmarks/generation/profile_decode.py reads them).

A range is opened only while a profiler runs: ``record_function`` costs microseconds even
without one (two operator calls), on the host that keeps the GPU fed between stop agreements. The
driver and the runner open ranges around compiled functions and CUDA-graph captures, never inside
them, so no compiled graph or captured CUDA graph holds one.
"""

from __future__ import annotations

import contextlib

import torch

from .._upstream import torch as torch_up

#: Every phase the static loop labels, in the order a call meets them: the whole call, the
#: prompt's forward, the loop's lookup, filling its buffers, the first token's choice, binding the
#: features and the cache, a late check's snapshot, a stop agreement, the loop's first step ever
#: (uncaptured), a CUDA-graph capture, a graph's replay, an uncaptured step, reading the result.
PHASES = (
    "decode",
    "prefill",
    "loop_lookup",
    "start",
    "first_token",
    "bind",
    "snapshot",
    "agree",
    "first_step",
    "capture",
    "replay",
    "step",
    "result",
)

_OFF = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """``hf_zero3.<name>``'s profiler range while a profiler runs, else a no-op."""
    return torch.profiler.record_function(f"hf_zero3.{name}") if torch_up.profiler_running() else _OFF
