"""Where the time of one compiled rollout goes (issue #14): phases of a call, the kernels of one
decode step, the cost of the CUDA-graph sizes, compile modes, and whether the gathered
parameters and the static cache keep their addresses from one call to the next.

Same model and setup as ``bench_decode.py`` (Llama-3.2-1B shape, bf16, ZeRO-3, 64-token prompts,
128 new tokens, one rank). A diagnosis tool, not a benchmark: it synchronizes around each phase.
Prints one JSON object per measurement (``^{``) and writes them to ``profile_decode.json``.
Modes: ``default`` (torch.compile's defaults), ``max-autotune`` (inductor's GEMM autotuning),
``combo`` (inductor's ``combo_kernels``: independent small kernels launched as one). Per mode it
also profiles one prefill (GPU busy time and top kernels against its wall time) and the host
functions of one whole warm call (cProfile, top cumulative).
Run: python benchmarks/generation/profile_decode.py   (GPU only; PROFILE_MODES=default,max-autotune,combo)
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import llama_1b_config, save, world_and_backend  # noqa: E402

MAX_NEW, PROMPT = 128, 64
MODES = os.environ.get("PROFILE_MODES", "default,max-autotune").split(",")
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "8,64").split(",")]


def rank_main():
    import deepspeed
    import torch
    import hf_zero3
    from hf_zero3.generation import graph_decode as gd
    from hf_zero3.testing import mark, models, strict_zero3_config

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = llama_1b_config()
    ds = strict_zero3_config(world_size=1, bf16=True)
    model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    module = engine.module
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

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
        cache = a[-2]["past_key_values"] if len(a) >= 2 else None
        layer = cache.layers[0] if cache is not None else None
        probe["ptrs"].append((tuple(p.data_ptr() for p in model.parameters()),
                              getattr(getattr(layer, "keys", None), "data_ptr", lambda: None)()))
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
            hf_zero3.lockstep_generate(engine, input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False,
                                       pad_token_id=0, eos_token_id=None, gather="all", sync_every=8,
                                       decode="compiled", graph_steps=graph_steps)
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        st = module.hf_zero3_last_generate
        d = dict(timers)
        steady = d.get("decode", 0) - d.get("prefill", 0) - d.get("first_step", 0) - d.get("capture", 0)
        return dict(total_s=total, outside_loop_s=total - d.get("decode", 0), prefill_s=d.get("prefill"),
                    first_step_s=d.get("first_step"), capture_s=d.get("capture"),
                    steady_ms_per_step=1e3 * steady / (MAX_NEW - 2), loop=st.loop, decode=st.decode,
                    graph_steps=st.graph_steps, compiles=st.compiles, reason=st.loop_reason or st.decode_reason)

    def set_mode(mode):
        torch._dynamo.reset()
        gd._COMPILED.clear()
        opts = {}
        torch._inductor.config.combo_kernels = mode == "combo"
        if mode == "max-autotune":
            torch._inductor.config.coordinate_descent_tuning = True
            opts = {"mode": "max-autotune-no-cudagraphs"}
        gd._compiled_call = lambda cls: gd._COMPILED.setdefault(cls, torch.compile(cls.__call__, fullgraph=True, **opts))

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
            emit(what="kernels", mode=mode, batch=batch, steps=n, gpu_us_per_step=total_us / n,
                 kernels_per_step=sum(v[0] for v in agg.values()) / n,
                 top=[(k[:110], v[0] / n, round(v[1] / n, 1)) for k, v in top])
            # one prefill's kernels against its wall time (GPU-bound or host-bound?)
            probe["prefill"] = True
            generate(batch, ids, 8)
            prof, wall = probe["prefill_result"]
            emit(what="prefill_kernels", mode=mode, batch=batch, wall_ms=wall * 1e3, **_kernels(prof, 1, 20))
            # the host side of one warm call: where the time outside the decode steps goes
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            generate(batch, ids, 8)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
            emit(what="host_profile", mode=mode, batch=batch,
                 top=[line.strip()[:160] for line in buf.getvalue().splitlines() if line.strip()][:60])

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
    emit(what="addresses", calls=["first", "back to back", "after a layer-wise forward", "after a training step"],
         params_same_as_first=[x[0] == p[0][0] for x in p], cache_same_as_first=[x[1] == p[0][1] for x in p],
         params_moved=[sum(a != b for a, b in zip(x[0], p[0][0])) for x in p], n_params=len(p[0][0]))
    return rows


def _kernels(prof, n: int, k: int) -> dict:
    import torch

    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.time_range.elapsed_us()
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:k]
    return dict(gpu_us=sum(v[1] for v in agg.values()) / n, kernels=sum(v[0] for v in agg.values()) / n,
                top=[(name[:110], c / n, round(us / n, 1)) for name, (c, us) in top])


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend(max_gpus=1)
    if backend != "nccl":
        print("profile_decode needs a CUDA GPU; skipped")
        return
    rows = run_ranks(rank_main, 1, backend=backend, init="deepspeed", timeout=560, pg_timeout=120,
                     capture=False)[0]
    print("raw numbers:", save("profile_decode", {"rows": rows}, HERE))


if __name__ == "__main__":
    main()
