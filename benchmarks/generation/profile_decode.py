"""Where the time of one compiled rollout goes: phases of a call, the kernels of one
decode step, the cost of the CUDA-graph sizes, compile modes, and whether the gathered
parameters and the static cache keep their addresses from one call to the next.

Same model and setup as ``bench_decode.py`` (Llama-3.2-1B shape, bf16, ZeRO-3, 64-token prompts,
128 new tokens, one rank). A diagnosis tool, not a benchmark: it synchronizes around each phase.
Prints one JSON object per measurement (``^{``) and writes them to ``profile_decode.json`` in
``benchmarks/out`` (``$BENCH_RESULTS`` when set): a diagnosis, not results to keep.
Modes: ``default`` (torch.compile's defaults), ``max-autotune`` (inductor's GEMM autotuning),
``combo`` (inductor's ``combo_kernels``: independent small kernels launched as one). Per mode it
also profiles one prefill (GPU busy time and top kernels against its wall time) and the host
functions of one whole warm call (cProfile, top cumulative).
``PROFILE_TIMELINE=1`` instead traces one warm call (host and GPU, no syncs added) and prints the
GPU's idle time inside it: the total, and the largest gaps with the host work that ran during each
(labelled phases of hf_zero3's call and the top-level host ops), and the call's kernels; once per
``PROFILE_VARIANTS`` entry (switches and ``sync_every``, see ``_variants``), same process.
``PROFILE_EVENTS=1`` instead runs three warm calls and then ``PROFILE_EVENT_CALLS`` (default 3)
more with no profiler: each labelled phase records its host time and a CUDA event at entry and
exit, so the table says, phase by phase, how far the GPU ran behind the host (``lag_ms``: the GPU
reached the event that much after the host recorded it; ~0: the GPU had nothing queued, it waited
for the host) without the tracer's own cost (it made a traced call ~25 % longer).
``PROFILE_HOST=1`` instead runs three warm calls and one under cProfile (top functions by own and
by cumulative time): where the host time of a call goes, outside the replayed steps.
Run: python benchmarks/generation/profile_decode.py   (GPU only; PROFILE_MODES=default,max-autotune,combo)
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import command, environment, scratch_dir, set_switches, world_and_backend  # noqa: E402

MAX_NEW, PROMPT = 128, 64
MODES = os.environ.get("PROFILE_MODES", "default,max-autotune").split(",")
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "8,64").split(",")]


def rank_main():
    import deepspeed
    import torch

    import hf_zero3
    from hf_zero3.decode import static_loop as gd
    from hf_zero3.testing import mark, models, strict_zero3_config

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = models.llama_1b_shape_config()
    ds = strict_zero3_config(world_size=1, bf16=True)
    model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    module = engine.module
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    if os.environ.get("PROFILE_TIMELINE") == "1":  # before any synced wrapper is installed
        for batch in BATCHES:
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)
            variants = _variants()
            for variant, every, switches in variants:
                hf_zero3.release_decode_graphs(module)
                set_switches(switches, {k for _, _, sw in variants for k in sw})
                for _ in range(3):  # compile, then warm calls (a graph's first replays upload it)
                    t = time.perf_counter()
                    _call(hf_zero3, engine, ids, every)
                    torch.cuda.synchronize()
                    emit(
                        what="warmup",
                        variant=variant,
                        batch=batch,
                        seconds=time.perf_counter() - t,
                        graphs_reused=module.hf_zero3_last_generate.graphs_reused,
                    )
                emit(what="timeline", variant=variant, batch=batch, **_timeline(hf_zero3, engine, ids, every))
        return rows

    if os.environ.get("PROFILE_EVENTS") == "1":  # phases timed by host clock and CUDA events, no tracer
        for batch in BATCHES:
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)
            for variant, every, switches in _variants():
                hf_zero3.release_decode_graphs(module)
                set_switches(switches, {k for _, _, sw in _variants() for k in sw})
                for _ in range(3):
                    _call(hf_zero3, engine, ids, every)
                torch.cuda.synchronize()
                for _ in range(int(os.environ.get("PROFILE_EVENT_CALLS", 3))):
                    emit(what="events", variant=variant, batch=batch, **_events(hf_zero3, engine, ids, every))
        return rows

    if os.environ.get("PROFILE_HOST") == "1":  # the host side of a warm call, nothing else
        for batch in BATCHES:
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)
            for _ in range(3):
                t = time.perf_counter()
                _call(hf_zero3, engine, ids)
                torch.cuda.synchronize()
                emit(what="warmup", batch=batch, seconds=time.perf_counter() - t)
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            _call(hf_zero3, engine, ids)
            torch.cuda.synchronize()
            pr.disable()
            for order, n in (("tottime", 40), ("cumulative", 70)):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(n)
                lines = [ln.strip()[:170] for ln in buf.getvalue().splitlines() if ln.strip()]
                emit(what=f"host_profile_{order}", batch=batch, top=lines[: n + 6])
            emit(what="prefill_host_ops", batch=batch, **_prefill_ops(hf_zero3, engine, ids))
        return rows

    timers = collections.defaultdict(float)
    probe = {"profile": False, "result": None, "ptrs": [], "prefill": False, "prefill_result": None}

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            timers[name] += time.perf_counter() - t
            return out

        return wrapper

    orig_prefill = gd._prefill  # the prompt's forward (timed alone: synced before and after)

    def prefill(*a, **k):
        if not probe["prefill"]:
            return orig_prefill(*a, **k)
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = orig_prefill(*a, **k)
            torch.cuda.synchronize()
        probe["prefill_result"] = (prof, time.perf_counter() - t)
        probe["prefill"] = False
        return out

    gd._prefill = timed("prefill", prefill)
    gd._Runner._first = timed("first_step", gd._Runner._first)
    gd._Runner._capture = timed("capture", gd._Runner._capture)
    orig_decode = gd.decode

    def decode(model, call, input_ids, *a, **k):
        from hf_zero3._upstream import transformers as hf_up

        cache = hf_up.generation_cache(a[-2]) if len(a) >= 2 else None
        layer = cache.layers[0] if cache is not None else None
        probe["ptrs"].append(
            (
                tuple(p.data_ptr() for p in model.parameters()),
                getattr(getattr(layer, "keys", None), "data_ptr", lambda: None)(),
            )
        )
        return orig_decode(model, call, input_ids, *a, **k)

    gd.decode = timed("decode", decode)
    orig_run = gd._Runner.run

    def run(self, n):
        if probe["profile"] and self.loop.warm and probe["result"] is None:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                orig_run(self, n)
                torch.cuda.synchronize()
            probe["result"] = (prof, n)
            return
        return orig_run(self, n)

    gd._Runner.run = run

    def generate(batch, ids, graph_steps):
        timers.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf_zero3.lockstep_generate(
                engine,
                input_ids=ids,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                gather="all",
                sync_every=8,
                decode="compiled",
                graph_steps=graph_steps,
            )
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        st = module.hf_zero3_last_generate
        d = dict(timers)
        steady = d.get("decode", 0) - d.get("prefill", 0) - d.get("first_step", 0) - d.get("capture", 0)
        return dict(
            total_s=total,
            outside_loop_s=total - d.get("decode", 0),
            prefill_s=d.get("prefill"),
            first_step_s=d.get("first_step"),
            capture_s=d.get("capture"),
            steady_ms_per_step=1e3 * steady / (MAX_NEW - 2),
            loop=st.loop,
            decode=st.decode,
            graph_steps=st.graph_steps,
            compiles=st.compiles,
            reason=st.loop_reason or st.decode_reason,
        )

    def set_mode(mode):
        torch._dynamo.reset()
        gd._COMPILED.clear()
        opts = {}
        torch._inductor.config.combo_kernels = mode == "combo"
        if mode == "max-autotune":
            torch._inductor.config.coordinate_descent_tuning = True
            opts = {"mode": "max-autotune-no-cudagraphs"}
        gd._compiled_call = lambda cls, dependent=False: gd._COMPILED.setdefault(
            (cls, dependent), torch.compile(cls.__call__, fullgraph=True, **opts)
        )

    for mode in MODES:
        set_mode(mode)
        for batch in BATCHES:
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)
            mark(f"{mode} batch {batch} first call")
            t = time.perf_counter()
            first = generate(batch, ids, 8)
            emit(what="first_call", mode=mode, batch=batch, seconds=time.perf_counter() - t, **first)
            for graph_steps in (8, 1, 0):
                for rep in range(2):
                    mark(f"{mode} batch {batch} graph_steps {graph_steps} rep {rep}")
                    r = generate(batch, ids, graph_steps)
                emit(what="phases", mode=mode, batch=batch, **r)
            # the kernels of one stretch of uncaptured compiled steps
            probe["profile"], probe["result"] = True, None
            generate(batch, ids, 0)
            probe["profile"] = False
            prof, n = probe["result"]
            agg = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    a = agg[e.name]
                    a[0] += 1
                    a[1] += e.time_range.elapsed_us()
            total_us = sum(v[1] for v in agg.values())
            top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]
            emit(
                what="kernels",
                mode=mode,
                batch=batch,
                steps=n,
                gpu_us_per_step=total_us / n,
                kernels_per_step=sum(v[0] for v in agg.values()) / n,
                top=[(k[:110], v[0] / n, round(v[1] / n, 1)) for k, v in top],
            )
            # one prefill's kernels against its wall time (GPU-bound or host-bound?)
            probe["prefill"] = True
            generate(batch, ids, 8)
            prof, wall = probe["prefill_result"]
            emit(what="prefill_kernels", mode=mode, batch=batch, wall_ms=wall * 1e3, **_kernels(prof, 1, 20))
            # the host side of one warm call: where the time outside the decode steps goes
            pr = cProfile.Profile()
            pr.enable()
            generate(batch, ids, 8)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
            emit(
                what="host_profile",
                mode=mode,
                batch=batch,
                top=[line.strip()[:160] for line in buf.getvalue().splitlines() if line.strip()][:60],
            )

    # addresses across calls: back to back, after a layer-wise forward, after a training step
    probe["ptrs"].clear()
    ids = torch.randint(3, cfg.vocab_size, (8, PROMPT), generator=torch.Generator().manual_seed(0)).to(dev)
    generate(8, ids, 8)
    generate(8, ids, 8)
    with torch.no_grad():
        engine(input_ids=ids)
    generate(8, ids, 8)
    engine.train()
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    engine.eval()
    generate(8, ids, 8)
    p = probe["ptrs"]
    emit(
        what="addresses",
        calls=["first", "back to back", "after a layer-wise forward", "after a training step"],
        params_same_as_first=[x[0] == p[0][0] for x in p],
        cache_same_as_first=[x[1] == p[0][1] for x in p],
        params_moved=[sum(a != b for a, b in zip(x[0], p[0][0])) for x in p],
        n_params=len(p[0][0]),
    )
    return rows


_LABELS = (
    ("hf_zero3.generation.lockstep", "_Call", "begin"),
    ("hf_zero3.generation.lockstep", "_Call", "validated"),
    ("hf_zero3.generation.lockstep", "_Call", "end"),
    ("hf_zero3.generation.lockstep", "_Call", "keep_going"),
    ("hf_zero3.generation.lockstep", "_Call", "finish_loop"),
    ("hf_zero3.gathering", None, "_decide"),
    ("hf_zero3.decode.static_loop", None, "_prefill"),
    ("hf_zero3.decode.static_loop", None, "_loop_for"),
    ("hf_zero3.decode.static_loop", "_Loop", "start"),
    ("hf_zero3.decode.static_loop", "_Loop", "result"),
    ("hf_zero3.decode.static_loop", "_Loop", "finished"),
    ("hf_zero3.decode.static_loop", "_Runner", "run"),
    ("hf_zero3.decode.fused_qkv", "Fused", "bind"),
    ("hf_zero3.generation.lockstep", "Zero3GenerationMixin", "generate"),
    ("hf_zero3.generation.lockstep", "Zero3GenerationMixin", "_sample"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters", "__enter__"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters", "__exit__"),
)


def _variants() -> list[tuple[str, int, dict]]:
    """``PROFILE_VARIANTS``: ``name[:sync=N][,SWITCH=VALUE...]`` separated by ``;`` (default: the
    library's defaults at sync_every=8), e.g. ``default;no_rope:HF_ZERO3_FUSE_ROPE=0;sync1:sync=1``."""
    out = []
    for item in os.environ.get("PROFILE_VARIANTS", "default").split(";"):
        name, _, rest = item.partition(":")
        settings = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        out.append((name, int(settings.pop("sync", 8)), settings))
    return out


def _call(hf_zero3, engine, ids, sync_every: int = 8) -> None:
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
            graph_steps=8,
        )


@contextlib.contextmanager
def _labelled(labels, around):
    """Within the block, each ``(module, class or None, function)`` of ``labels`` that exists is
    replaced by ``around(fn, "Class.function")`` (the traced and the stamped profiles' phases)."""
    import importlib

    undo = []
    try:
        for mod_name, cls_name, attr in labels:
            try:
                owner = importlib.import_module(mod_name)
                owner = getattr(owner, cls_name) if cls_name else owner
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue
            setattr(owner, attr, around(fn, f"{cls_name + '.' if cls_name else ''}{attr}"))
            undo.append((owner, attr, fn))
        yield
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)


def _timeline(hf_zero3, engine, ids, sync_every: int = 8) -> dict:
    """One warm call traced (host and GPU): the GPU's idle time and what the host did meanwhile."""
    import functools

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    def around(fn, label):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(f"hz3:{label}"):
                return fn(*a, **k)

        return inner

    with _labelled(_LABELS, around):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("hz3:call"):
                _call(hf_zero3, engine, ids, sync_every)
            torch.cuda.synchronize()
    events = list(prof.events())
    call = next(e for e in events if e.name == "hz3:call")
    t0, t1 = call.time_range.start, call.time_range.end
    gpu = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, gaps, cur = 0.0, [], None
    for s, e in gpu:
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
    if cur is not None:
        busy += cur[1] - cur[0]
        gaps.append((cur[1], t1))
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    labels = [e for e in cpu if e.name.startswith("hz3:") and e.name != "hz3:call"]
    tops = [e for e in cpu if e.cpu_parent is None or e.cpu_parent.name.startswith("hz3:")]
    tops = [e for e in tops if not e.name.startswith("hz3:")]

    def during(s, e, evs, n):
        over = collections.Counter()
        for ev in evs:
            o = min(e, ev.time_range.end) - max(s, ev.time_range.start)
            if o > 0:
                over[ev.name[:70]] += o
        return [(k, round(v)) for k, v in over.most_common(n)]

    by_label = collections.Counter()
    for s, e in gaps:
        inner = [lab for lab in labels if lab.time_range.start <= s and lab.time_range.end >= e]
        name = min(inner, key=lambda lab: lab.time_range.end - lab.time_range.start).name if inner else "(none)"
        by_label[name] += e - s
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:25]
    kernels = _kernels(prof, 1, 24)
    # programmatic dependent launches show as a kernel starting before the one before it ended
    runs = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith("hz3:")
        and e.time_range.end > e.time_range.start
    )
    overlaps = [prev[1] - nxt[0] for prev, nxt in zip(runs, runs[1:]) if nxt[0] < prev[1]]
    return dict(
        call_ms=(t1 - t0) / 1e3,
        gpu_busy_ms=busy / 1e3,
        gpu_idle_ms=sum(e - s for s, e in gaps) / 1e3,
        kernels_overlapping=len(overlaps),
        kernel_overlap_ms=sum(overlaps) / 1e3,
        gaps=len(gaps),
        kernels=kernels["kernels"],
        top_kernels=kernels["top"],
        idle_by_phase_ms={k: round(v / 1e3, 3) for k, v in by_label.most_common()},
        largest=[
            dict(
                at_ms=round((s - t0) / 1e3, 3),
                us=round(e - s),
                labels=during(s, e, labels, 3),
                host=during(s, e, tops, 4),
            )
            for s, e in big
        ],
    )


# transformers' own steps of a generate() call before the decode loop, timed beside ours
_EVENT_LABELS = _LABELS + tuple(
    ("transformers.generation.utils", "GenerationMixin", name)
    for name in (
        "_prepare_generation_config",
        "_prepare_special_tokens",
        "_prepare_cache_for_generation",
        "_get_logits_processor",
        "_prepare_model_inputs",
    )
)


def _events(hf_zero3, engine, ids, sync_every: int = 8) -> dict:
    """One warm call, each labelled phase's entry and exit stamped with the host clock and a CUDA
    event (none inside a graph capture): the phases in call order with their host times and how far
    the GPU ran behind the host at each stamp."""
    import functools

    import torch

    stamps = []

    def stamp(label):
        ev = None
        if not torch.cuda.is_current_stream_capturing():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        stamps.append((label, time.perf_counter(), ev))

    def around(fn, label):
        @functools.wraps(fn)
        def inner(*a, **k):
            stamp(f"> {label}")
            try:
                return fn(*a, **k)
            finally:
                stamp(f"< {label}")

        return inner

    with _labelled(_EVENT_LABELS, around):
        torch.cuda.synchronize()
        stamp("call")
        _call(hf_zero3, engine, ids, sync_every)
        stamp("returned")
        torch.cuda.synchronize()
        stamp("synced")
    _, h0, e0 = stamps[0]
    rows = []
    for label, h, ev in stamps:
        host = (h - h0) * 1e3
        gpu = e0.elapsed_time(ev) if ev is not None else None
        rows.append(
            (
                label,
                round(host, 3),
                None if gpu is None else round(gpu, 3),
                None if gpu is None else round(gpu - host, 3),
            )
        )
    return dict(call_ms=rows[-1][1], columns=["stamp", "host_ms", "gpu_ms", "lag_ms"], stamps=rows)


def _prefill_ops(hf_zero3, engine, ids) -> dict:
    """One warm call's prompt forward traced alone (host ops with their input shapes): which host
    ops its time goes to, and every ``aten::copy_`` it issues (a copy to the GPU inside the compiled
    forward can block the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hf_zero3.decode import static_loop as gd

    own, seen = gd._prefill, {}

    def traced(*a, **k):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            t = time.perf_counter()
            out = own(*a, **k)
            seen["host_ms"] = (time.perf_counter() - t) * 1e3
            torch.cuda.synchronize()
        seen["prof"] = prof
        return out

    gd._prefill = traced
    try:
        _call(hf_zero3, engine, ids)
        torch.cuda.synchronize()
    finally:
        gd._prefill = own
    prof = seen["prof"]
    table = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:30]
    copies = [
        dict(
            shapes=str(e.input_shapes)[:160],
            host_us=round(e.time_range.elapsed_us(), 1),
            parent=e.cpu_parent.name[:80] if e.cpu_parent is not None else None,
        )
        for e in prof.events()
        if e.name == "aten::copy_"
    ][:40]
    return dict(
        host_ms=seen["host_ms"],
        top=[(e.key[:70], str(e.input_shapes)[:120], e.count, round(e.self_cpu_time_total, 1)) for e in table],
        copies=copies,
    )


def _kernels(prof, n: int, k: int) -> dict:
    import torch

    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.time_range.elapsed_us()
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:k]
    return dict(
        gpu_us=sum(v[1] for v in agg.values()) / n,
        kernels=sum(v[0] for v in agg.values()) / n,
        top=[(name[:110], c / n, round(us / n, 1)) for name, (c, us) in top],
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
