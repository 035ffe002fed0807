"""A real model's FX graph with ZeRO-3's gather/release structure, profiled on CPU.

DeepCompile only runs on CUDA, but its planning input is an FX graph plus a profile. This module
records both from a real ``transformers`` model on CPU: ``make_fx`` traces the forward into aten
ops (weights as graph inputs), a gather node is inserted before each weight's first use and a
release after its last (what DeepSpeed's ``zero3_compile`` pass does), and an interpreter runs
the graph measuring each node's time and the live tensor bytes (values freed after their last
use, gathered weights live from gather to release, every weight's shard resident). Gather time
is modelled (``GATHER_LATENCY`` + bytes / ``GATHER_BANDWIDTH``): there is no NCCL on CPU.

The result has the shape of DeepCompile's ``ProfilingResult`` (``fwd_graph``, ``fwd_mem``,
``fwd_time``, ``fwd_tensor_sizes``), so :func:`hf_zero3.compile.profile.profile_from_deepcompile`
reads it, and the graph runs: :func:`hf_zero3.compile.memory_plan._rewrite` can be applied to it
and executed, gate ops included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Interpreter
from torch.utils import _pytree as pytree

from hf_zero3.compile.planner import GATHER, RELEASE

__all__ = [
    "gather",
    "release",
    "RecordedProfile",
    "record_zero3_graph",
    "record_tiny_model",
    "record_tiny_backward",
    "collective_issue",
    "STAND_IN_OPS",
]

GATHER_LATENCY = 20e-6
GATHER_BANDWIDTH = 25e9


def gather(param: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    """Stand-in for ``dc.allgather_param`` (the CPU graph holds whole weights)."""
    return param


def release(param: torch.Tensor, graph_id: int, ds_id: int, n_users: int) -> torch.Tensor:
    """Stand-in for ``dc.release_param``."""
    return param


STAND_IN_OPS = {gather: GATHER, release: RELEASE}


@dataclass
class RecordedProfile:
    """Fields named as DeepCompile's ``ProfilingResult`` (forward graph only)."""

    fwd_graph: object
    fwd_mem: list = field(default_factory=list)  # (name, alloc after, delta, peak)
    fwd_time: list = field(default_factory=list)  # (name, device ms, wall ms)
    fwd_tensor_sizes: list = field(default_factory=list)  # (name, bytes)
    process_group: object = None
    gm: GraphModule | None = None
    inputs: tuple = ()


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def record_zero3_graph(
    model: torch.nn.Module, input_ids: torch.Tensor, world_size: int = 2, repeats: int = 3
) -> RecordedProfile:
    """Trace, insert gathers/releases, and profile ``model(input_ids).logits`` on CPU."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params = {n: p.detach() for n, p in model.named_parameters()}

    def fn(params, ids):
        mask = torch.ones_like(ids)  # an explicit mask: no data-dependent packed-sequence check
        return torch.func.functional_call(model, params, (ids,), {"attention_mask": mask, "use_cache": False}).logits

    with torch.no_grad():
        gm = make_fx(fn)(params, input_ids)
    inputs = tuple(pytree.tree_leaves((params, input_ids)))
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][: len(params)]
    shard_bytes = 0
    for ds_id, (ph, p) in enumerate(zip(placeholders, params.values())):
        shard_bytes += _nbytes(p) // world_size
        users = sorted(ph.users, key=order.get)
        if not users:
            continue
        with graph.inserting_before(users[0]):
            g = graph.call_function(gather, (ph, 0, ds_id))
        for u in users:
            u.replace_input_with(ph, g)
        with graph.inserting_after(users[-1]):
            graph.call_function(release, (g, 0, ds_id, len(users)))
    graph.lint()
    gm.recompile()

    rec = RecordedProfile(fwd_graph=graph, gm=gm, inputs=inputs)
    times = {}
    for _ in range(repeats):  # best of N: CPU timing noise
        prof = _Profiler(gm, shard_bytes)
        prof.run(*inputs)
        for name, t in prof.times.items():
            times[name] = min(t, times.get(name, t))
    for node in graph.nodes:
        name = node.name
        alloc, peak = prof.mem[name]
        nbytes = prof.sizes.get(name, 0)  # gathered bytes; 0 for other nodes
        t = GATHER_LATENCY + nbytes / GATHER_BANDWIDTH if node.target is gather else times.get(name, 0.0)
        rec.fwd_mem.append((name, alloc, 0, peak))
        rec.fwd_time.append((name, t * 1e3, t * 1e3))
        rec.fwd_tensor_sizes.append((name, nbytes))
    return rec


def record_tiny_model(config=None, repeats: int = 1) -> RecordedProfile:
    """:func:`record_zero3_graph` of a tiny model built in code (default: a 64-wide Llama), seeded,
    on a fixed batch of 2 x 16 tokens: every rank and test records the same graph."""
    from hf_zero3.testing import models

    cfg = config or models.tiny_llama_config(hidden_size=64, intermediate_size=128, vocab_size=256)
    torch.manual_seed(0)
    model = models.model_class_for(cfg)(cfg).eval()
    return record_zero3_graph(model, torch.randint(3, cfg.vocab_size, (2, 16)), repeats=repeats)


def record_tiny_backward() -> RecordedProfile:
    """:func:`record_tiny_model` with its fields also standing for a backward graph: DeepCompile
    hands the memory-plan pass a backward graph's fields, and the recorded forward plays it."""
    rec = record_tiny_model()
    rec.bwd_graph, rec.bwd_mem, rec.bwd_time = rec.fwd_graph, rec.fwd_mem, rec.fwd_time
    rec.bwd_tensor_sizes, rec.fwd_mem_complete, rec.bwd_mem_complete = rec.fwd_tensor_sizes, True, True
    return rec


def collective_issue(issued: list):
    """An issue function for :func:`hf_zero3.compile.gate.set_issue_fn` that runs a real gloo
    all-reduce per issued prefetch (as DeepCompile's all-gather would) and appends its ids to
    ``issued``: ranks whose gates disagree hang or fail instead of passing silently."""
    import torch.distributed as dist

    def issue(graph_id, params, ids):
        t = torch.tensor([float(sum(ids) + 1)])
        dist.all_reduce(t)
        issued.append(tuple(ids))

    return issue


class _Profiler(Interpreter):
    """Runs the graph once, recording per node: wall time, live bytes after it, peak during it."""

    def __init__(self, gm: GraphModule, resident: int):
        super().__init__(gm, garbage_collect_values=False)
        self.resident = resident
        self.times, self.mem, self.sizes = {}, {}, {}
        self.live: dict[str, int] = {}
        self.gathered: dict[int, int] = {}
        nodes = list(gm.graph.nodes)
        self.last_use = {}
        for i, n in enumerate(nodes):
            for inp in n.all_input_nodes:
                self.last_use[inp.name] = i
        self.index = {n.name: i for i, n in enumerate(nodes)}

    def _current(self) -> int:
        return self.resident + sum(self.live.values()) + sum(self.gathered.values())

    def run_node(self, n):
        t = time.perf_counter()
        out = super().run_node(n)
        self.times[n.name] = time.perf_counter() - t
        before = self._current()
        if n.target is gather:
            self.gathered[n.args[2]] = _nbytes(out)
            self.sizes[n.name] = _nbytes(out)
        elif n.target is release:
            self.gathered.pop(n.args[2], None)
        elif n.op not in ("placeholder", "output"):
            self.live[n.name] = sum(_nbytes(x) for x in pytree.tree_leaves(out))
        peak = max(before, self._current())
        i = self.index[n.name]
        for inp in n.all_input_nodes:  # free values whose last use was this node
            if self.last_use.get(inp.name) == i:
                self.live.pop(inp.name, None)
        self.mem[n.name] = (self._current(), peak)
        return out
