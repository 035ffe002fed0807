"""Where the time of one compiled rollout goes, read from torch.profiler traces of the static
loop's own phase ranges (``hf_zero3.<phase>``: hf_zero3/decode/phases.py): the phases of a call,
the kernels of one decode step and of the prompt's forward, the cost of the CUDA-graph sizes,
compile modes, and whether a later call replays the graphs an earlier one captured.

Same model and setup as ``bench_decode.py`` (Llama-3.2-1B shape or ``BENCH_SHAPE``'s, bf16, ZeRO-3, 64-token prompts,
128 new tokens, one rank). A diagnosis tool, not a benchmark: a traced call runs ~25 % slower.
Prints one JSON object per measurement (``^{``) and writes them to ``profile_decode.json`` in
``benchmarks/out`` (``$BENCH_RESULTS`` when set).

Default, per mode (``PROFILE_MODES``: ``default``, ``max-autotune``: inductor's GEMM autotuning,
``combo``: its ``combo_kernels``) and batch (``BENCH_BATCHES``): the compiling call
(``first_call``); per ``graph_steps`` (8, 1, 0) one traced warm call (``phases``: the prompt's
forward and the loop's first step and captures with their GPU work, the steady time per step,
and each phase's count, host and GPU time); the kernels of one uncaptured step and of the prompt's
forward (``kernels``, ``prefill_kernels``); one warm call's host functions (cProfile); then
``reuse``: whether the call back to back, after a layer-wise forward and after a training step
replays the graphs the first one captured.
``PROFILE_TIMELINE=1`` instead traces one warm call per ``PROFILE_VARIANTS`` entry (switches and
``sync_every``, see ``_variants``): the GPU's idle time by phase, the largest gaps with the host
work during each, and how far behind the host the GPU began each phase (``lag_ms``).
``PROFILE_HOST=1`` instead profiles one warm call's host (cProfile, by own and cumulative time)
and its prompt forward's host ops (with input shapes, every ``aten::copy_``).
A range the tool reads that a trace lacks stops the run: the loop's labels are its contract.
Run: python benchmarks/generation/profile_decode.py   (GPU only)
"""

from __future__ import annotations

import bisect
import collections
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import command, environment, scratch_dir, set_switches, shape_config, world_and_backend  # noqa: E402

MAX_NEW, PROMPT = 128, 64
MODES = os.environ.get("PROFILE_MODES", "default,max-autotune").split(",")
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "8,64").split(",")]
PREFIX, CALL = "hf_zero3.", "profile_decode.call"
#: the ranges every static-loop call with stop="sync" opens (besides "replay" or "step")
EVERY_CALL = ("decode", "prefill", "loop_lookup", "start", "first_token", "bind", "snapshot", "agree", "result")


def rank_main():
    import deepspeed
    import torch

    import hf_zero3
    from hf_zero3.decode.phases import PHASES
    from hf_zero3.testing import mark, models, strict_zero3_config

    unknown = set(EVERY_CALL + ("replay", "step", "first_step", "capture")) - set(PHASES)
    if unknown:
        raise RuntimeError(f"profile_decode reads ranges the loop no longer opens: {sorted(unknown)}")
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = shape_config(os.environ.get("BENCH_SHAPE", "llama-1b"))
    ds = strict_zero3_config(world_size=1, bf16=True)
    model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    module = engine.module
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    def prompts(batch):
        g = torch.Generator().manual_seed(batch)
        return torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)

    if os.environ.get("PROFILE_TIMELINE") == "1":
        variants = _variants()
        for batch in BATCHES:
            ids = prompts(batch)
            for variant, every, switches in variants:
                hf_zero3.release_decode_graphs(module)
                set_switches(switches, {k for _, _, sw in variants for k in sw})
                for _ in range(3):  # compile, then warm calls (a graph's first replays upload it)
                    _call(hf_zero3, engine, ids, sync_every=every)
                trace, _ = _traced(lambda: _call(hf_zero3, engine, ids, sync_every=every))
                trace.require(*EVERY_CALL)
                reused = module.hf_zero3_last_generate.graphs_reused
                emit(what="timeline", variant=variant, batch=batch, graphs_reused=reused, **_timeline(trace))
        return rows

    if os.environ.get("PROFILE_HOST") == "1":
        for batch in BATCHES:
            ids = prompts(batch)
            for _ in range(3):
                _call(hf_zero3, engine, ids)
            emit(
                what="host_profile",
                batch=batch,
                **_host_profile(lambda: _call(hf_zero3, engine, ids), tottime=40, cumulative=70),
            )
            trace, _ = _traced(lambda: _call(hf_zero3, engine, ids), record_shapes=True)
            emit(what="prefill_host_ops", batch=batch, **_prefill_ops(trace))
        return rows

    for mode in MODES:
        _set_mode(hf_zero3, mode)
        for batch in BATCHES:
            ids = prompts(batch)
            mark(f"{mode} batch {batch} first call")
            t = time.perf_counter()
            _call(hf_zero3, engine, ids)
            torch.cuda.synchronize()
            emit(what="first_call", mode=mode, batch=batch, seconds=time.perf_counter() - t, **_stats(module))
            for graph_steps in (8, 1, 0):
                mark(f"{mode} batch {batch} graph_steps {graph_steps}")
                _call(hf_zero3, engine, ids, graph_steps=graph_steps)  # captures this size's graphs
                trace, wall = _traced(lambda: _call(hf_zero3, engine, ids, graph_steps=graph_steps))
                trace.require(*EVERY_CALL, "replay" if graph_steps else "step")
                emit(what="phases", mode=mode, batch=batch, **_phases(trace, wall, module))
                if not graph_steps:  # the kernels of one uncaptured step, and of the prompt's forward
                    steps = len(trace.host["step"])
                    emit(what="kernels", mode=mode, batch=batch, steps=steps, **_kernel_table(trace, "step", 30, steps))
                    wall_ms = trace.span("prefill") / 1e3
                    emit(
                        what="prefill_kernels",
                        mode=mode,
                        batch=batch,
                        wall_ms=wall_ms,
                        **_kernel_table(trace, "prefill", 20),
                    )
            host = _host_profile(lambda: _call(hf_zero3, engine, ids), cumulative=45)
            emit(what="host_profile", mode=mode, batch=batch, **host)
    emit(what="reuse", **_reuse(hf_zero3, engine, prompts(8)))
    return rows


def _call(hf_zero3, engine, ids, sync_every: int = 8, graph_steps: int = 8) -> None:
    import torch

    with torch.no_grad():
        hf_zero3.lockstep_generate(
            engine,
            input_ids=ids,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            gather="all",
            sync_every=sync_every,
            decode="compiled",
            graph_steps=graph_steps,
        )


def _stats(module) -> dict:
    st = module.hf_zero3_last_generate
    return dict(
        loop=st.loop,
        decode=st.decode,
        graph_steps=st.graph_steps,
        compiles=st.compiles,
        graph_capture_s=st.graph_capture_s,
        graphs_reused=st.graphs_reused,
        reason=st.loop_reason or st.decode_reason,
    )


def _set_mode(hf_zero3, mode: str) -> None:
    """Every function hf_zero3 compiles compiled again under ``mode``: inductor's global config,
    read when Dynamo compiles after a reset (hf_zero3's own options are patched over it)."""
    import torch

    torch._dynamo.reset()
    hf_zero3.release_decode_graphs()  # graphs of the last mode's kernels
    torch._inductor.config.combo_kernels = mode == "combo"
    torch._inductor.config.max_autotune = mode == "max-autotune"  # as mode="max-autotune-no-cudagraphs"
    torch._inductor.config.coordinate_descent_tuning = mode == "max-autotune"


def _variants() -> list[tuple[str, int, dict]]:
    """``PROFILE_VARIANTS``: ``name[:sync=N][,SWITCH=VALUE...]`` separated by ``;`` (default: the
    library's defaults at sync_every=8), e.g. ``default;no_rope:HF_ZERO3_FUSE_ROPE=0;sync1:sync=1``."""
    out = []
    for item in os.environ.get("PROFILE_VARIANTS", "default").split(";"):
        name, _, rest = item.partition(":")
        settings = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        out.append((name, int(settings.pop("sync", 8)), settings))
    return out


def _us(e) -> float:
    return e.time_range.end - e.time_range.start


class _Trace:
    """One traced call: the loop's ranges on the host and on the GPU (kineto shows a host range
    over the kernels launched inside it, under the same name), and the GPU's kernels."""

    def __init__(self, events):
        import torch

        cuda = torch.autograd.DeviceType.CUDA
        self.cpu = [e for e in events if e.device_type != cuda]
        names = {e.name for e in self.cpu}
        device = [e for e in events if e.device_type == cuda and _us(e) > 0]
        self.kernels = sorted((e for e in device if e.name not in names), key=lambda e: e.time_range.start)
        self.host, self.gpu = collections.defaultdict(list), collections.defaultdict(list)
        for into, evs in ((self.host, self.cpu), (self.gpu, device)):
            for e in sorted(evs, key=lambda e: e.time_range.start):
                if e.name.startswith(PREFIX):
                    into[e.name[len(PREFIX) :]].append(e)
        (call,) = [e for e in self.cpu if e.name == CALL]
        self.t0, self.t1 = call.time_range.start, call.time_range.end

    def require(self, *phases) -> None:
        missing = [f"{PREFIX}{p}" for p in phases if not self.host.get(p)]
        if missing:
            raise RuntimeError(f"the trace has no {missing} range: see hf_zero3/decode/phases.py")

    def span(self, phase: str) -> float:
        """Microseconds from the phase's first host entry to its last end, its GPU work included."""
        self.require(phase)
        evs = self.host[phase] + self.gpu.get(phase, [])
        return max(e.time_range.end for e in evs) - self.host[phase][0].time_range.start

    def summary(self, phase: str) -> dict:
        """Count, host and GPU milliseconds, and (where every entry launched GPU work) how far behind
        the host the GPU began it."""
        host, gpu = self.host[phase], self.gpu.get(phase, [])
        row = dict(n=len(host), host_ms=sum(map(_us, host)) / 1e3, gpu_ms=sum(map(_us, gpu)) / 1e3 if gpu else None)
        if gpu and len(gpu) == len(host):
            lags = [(g.time_range.start - h.time_range.start) / 1e3 for h, g in zip(host, gpu)]
            row.update(lag_ms_mean=sum(lags) / len(lags), lag_ms_max=max(lags))
        return row

    def kernels_in(self, phase: str) -> list:
        """The kernels that ran inside the phase's GPU ranges."""
        spans = [(e.time_range.start, e.time_range.end) for e in self.gpu.get(phase, [])]
        if not spans:
            raise RuntimeError(f"the trace has no GPU range {PREFIX}{phase} (no kernels inside it?)")
        starts = [s for s, _ in spans]
        out = []
        for k in self.kernels:
            i = bisect.bisect_right(starts, k.time_range.start) - 1
            if i >= 0 and k.time_range.start < spans[i][1]:
                out.append(k)
        return out


def _traced(fn, record_shapes: bool = False) -> tuple[_Trace, float]:
    """``fn()`` under torch's profiler (host and GPU), synchronized around: (its trace, wall seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=record_shapes) as prof:
        t = time.perf_counter()
        with record_function(CALL):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return _Trace(list(prof.events())), wall


def _phases(trace: _Trace, wall: float, module) -> dict:
    """The call's phases as the synchronized timers had them: the prompt's forward, the loop's
    first step and captures with their GPU work, the steady decode time per step, and each range."""
    st = module.hf_zero3_last_generate
    decode = trace.host["decode"][0]
    first = trace.span("first_step") if trace.host.get("first_step") else 0.0
    capture = trace.span("capture") if trace.host.get("capture") else 0.0
    prefill_end = trace.host["prefill"][0].time_range.start + trace.span("prefill")
    steady = decode.time_range.end - prefill_end - first - capture  # result() syncs: the steps are done
    steps = st.forwards - 1 - len(trace.host.get("first_step", []))
    return dict(
        total_s=wall,
        outside_loop_s=wall - _us(decode) / 1e6,
        prefill_s=trace.span("prefill") / 1e6,
        first_step_s=first / 1e6,
        capture_s=capture / 1e6,
        steady_ms_per_step=steady / 1e3 / max(steps, 1),
        **_stats(module),
        ranges={p: trace.summary(p) for p in trace.host},
    )


def _timeline(trace: _Trace) -> dict:
    """The GPU's idle time inside the call: by the innermost phase the host was in, the largest
    gaps with the host work during each, and each phase's summary."""
    t0, t1 = trace.t0, trace.t1
    busy, gaps, cur = 0.0, [], None
    for k in trace.kernels:
        s, e = k.time_range.start, k.time_range.end
        if cur is None:
            if s > t0:
                gaps.append((t0, s))
            cur = [s, e]
        elif s > cur[1]:
            busy += cur[1] - cur[0]
            gaps.append((cur[1], s))
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is None:
        gaps.append((t0, t1))
    else:
        busy += cur[1] - cur[0]
        gaps.append((cur[1], t1))
    labels = [e for evs in trace.host.values() for e in evs]

    def top_level(e) -> bool:  # a host op with no op around it but the loop's ranges
        p = e.cpu_parent
        while p is not None and (p.name.startswith(PREFIX) or p.name == CALL):
            p = p.cpu_parent
        return p is None and not e.name.startswith(PREFIX) and e.name != CALL

    tops = [e for e in trace.cpu if top_level(e)]

    def during(s, e, evs, n):
        over = collections.Counter()
        for ev in evs:
            o = min(e, ev.time_range.end) - max(s, ev.time_range.start)
            if o > 0:
                over[ev.name[:70]] += o
        return [(k, round(v)) for k, v in over.most_common(n)]

    by_phase = collections.Counter()
    for s, e in gaps:
        inner = [lab for lab in labels if lab.time_range.start <= s and lab.time_range.end >= e]
        by_phase[min(inner, key=_us).name if inner else "(outside the loop)"] += e - s
    runs = [(k.time_range.start, k.time_range.end) for k in trace.kernels]
    # programmatic dependent launches show as a kernel starting before the one before it ended
    overlaps = [prev[1] - nxt[0] for prev, nxt in zip(runs, runs[1:]) if nxt[0] < prev[1]]
    kernels = _kernel_table(trace, None, 24)
    return dict(
        call_ms=(t1 - t0) / 1e3,
        gpu_busy_ms=busy / 1e3,
        gpu_idle_ms=sum(e - s for s, e in gaps) / 1e3,
        kernels_overlapping=len(overlaps),
        kernel_overlap_ms=sum(overlaps) / 1e3,
        gaps=len(gaps),
        kernels=kernels["kernels"],
        top_kernels=kernels["top"],
        idle_by_phase_ms={k: round(v / 1e3, 3) for k, v in by_phase.most_common()},
        largest=[
            dict(
                at_ms=round((s - t0) / 1e3, 3),
                us=round(e - s),
                labels=during(s, e, labels, 3),
                host=during(s, e, tops, 4),
            )
            for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:25]
        ],
        ranges={p: trace.summary(p) for p in trace.host},
    )


def _kernel_table(trace: _Trace, phase: str | None, top: int, per: int = 1) -> dict:
    """GPU microseconds and kernels (per ``per`` entries) inside ``phase`` (None: the whole call),
    and the top kernels by GPU time."""
    agg = collections.defaultdict(lambda: [0, 0.0])
    for k in trace.kernels if phase is None else trace.kernels_in(phase):
        agg[k.name][0] += 1
        agg[k.name][1] += _us(k)
    best = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(
        gpu_us=sum(v[1] for v in agg.values()) / per,
        kernels=sum(v[0] for v in agg.values()) / per,
        top=[(name[:110], c / per, round(us / per, 1)) for name, (c, us) in best],
    )


def _host_profile(fn, **tops: int) -> dict:
    """``fn()`` under cProfile: its top functions in each order of ``tops`` (pstats' sort keys)."""
    import torch

    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    out = {}
    for order, n in tops.items():
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(n)
        out[f"top_{order}"] = [ln.strip()[:170] for ln in buf.getvalue().splitlines() if ln.strip()][: n + 6]
    return out


def _prefill_ops(trace: _Trace) -> dict:
    """The prompt forward's host ops (with input shapes) by own time, and every ``aten::copy_`` it
    issues (a copy to the GPU inside the compiled forward can block the host)."""
    trace.require("prefill")
    rng = trace.host["prefill"][0]
    s, e = rng.time_range.start, rng.time_range.end
    inside = [
        ev
        for ev in trace.cpu
        if ev is not rng and ev.thread == rng.thread and s <= ev.time_range.start and ev.time_range.end <= e
    ]
    agg = collections.defaultdict(lambda: [0, 0.0])
    for ev in inside:
        key = (ev.name[:70], str(ev.input_shapes)[:120])
        agg[key][0] += 1
        agg[key][1] += ev.self_cpu_time_total
    copies = [
        dict(
            shapes=str(ev.input_shapes)[:160],
            host_us=round(_us(ev), 1),
            parent=ev.cpu_parent.name[:80] if ev.cpu_parent is not None else None,
        )
        for ev in inside
        if ev.name == "aten::copy_"
    ]
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]
    return dict(
        host_ms=_us(rng) / 1e3,
        top=[(name, shapes, c, round(us, 1)) for (name, shapes), (c, us) in top],
        copies=copies[:40],
    )


def _reuse(hf_zero3, engine, ids) -> dict:
    """Whether a call replays the graphs the first call captured: back to back, after a layer-wise
    forward, after a training step. It does only where the gathered parameters, the static cache
    and the model's state are where and what they were (hf_zero3/decode/loop_cache.py)."""
    import torch

    module = engine.module
    hf_zero3.release_decode_graphs(module)
    seen = {}

    def call(name):
        _call(hf_zero3, engine, ids)
        seen[name] = _stats(module)

    call("first")
    call("back to back")
    with torch.no_grad():
        engine(input_ids=ids)
    call("after a layer-wise forward")
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.eval()
    call("after a training step")
    return dict(
        calls=list(seen),
        graphs_reused=[s["graphs_reused"] for s in seen.values()],
        graph_capture_s=[s["graph_capture_s"] for s in seen.values()],
    )


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend(max_gpus=1)
    if backend != "nccl":
        print("profile_decode needs a CUDA GPU; skipped")
        return
    rows = run_ranks(rank_main, 1, backend=backend, init="deepspeed", timeout=560, pg_timeout=120, capture=False)[0]
    path = os.path.join(scratch_dir(), "profile_decode.json")
    with open(path, "w") as f:
        json.dump({"command": command(), "environment": environment(), "rows": rows}, f, indent=1, default=str)
    print("profile written to", path)


if __name__ == "__main__":
    main()
