"""What a process's first compiled rollout costs, per model shape: from empty compile caches
("cold") and from the caches the cold process left ("warm"), against the same process's second
call (the rollout every later call costs).

Per shape (``BENCH_SHAPES``, comma-separated, default ``qwen2-0.5b,llama-1b,llama-8b``): one fresh
pair of ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``, then two processes in a row over it, the
cold one and the warm one. Each builds the shape under ZeRO-3 on one GPU (random weights, bf16) and
times two ``hf_zero3.lockstep_generate(decode="compiled", gather="all")`` calls at the library's
defaults: ``BENCH_BATCH`` (default 64) prompts of 64 tokens, 128 new tokens, greedy, no EOS.
``BENCH_CACHE_DIR``: where the caches' temporary folders are made (default: the system's).

Columns: ``first_call_s`` (the first call, everything it compiled, tuned and captured included);
``second_call_s``; of the first call, ``dynamo_s`` (Dynamo's ``compile_inner``: tracing, guards and
the backend), ``inductor_s`` (of it the backend, inductor), ``tracing_s`` (Dynamo's bytecode
tracing), ``autotune_s`` (Triton's autotuner choosing the launch configuration of hf_zero3's decode
GEMMs: compiling and timing each configuration on its first shape, or reading its cached choice)
and ``capture_s`` (CUDA graph capture); ``graphs``: the Dynamo graphs it compiled, ``graph_s`` each
one's seconds in the order compiled (the prompt's forward, the decode step, the greedy tail).
Run: python benchmarks/generation/bench_first_call.py   (GPU only)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import SHAPES, record, shape_config, table  # noqa: E402

BATCH = int(os.environ.get("BENCH_BATCH", 64))
PROMPT, MAX_NEW = 64, 128
_asked = os.environ.get("BENCH_SHAPES", ",".join(SHAPES)).split(",")
_unknown = sorted(set(_asked) - set(SHAPES))
if _unknown:
    raise SystemExit(f"BENCH_SHAPES names unknown shapes {_unknown}; known: {', '.join(SHAPES)}")


def _autotune_timer() -> tuple[list, dict]:
    """(seconds Triton's autotuner spent per launch that had no chosen configuration yet, the
    configuration it chose per kernel and key); the measurement wraps ``Autotuner.run``, nothing
    of hf_zero3 changes."""
    from triton.runtime.autotuner import Autotuner

    spent: list = []
    chosen: dict = {}
    run = Autotuner.run

    def timed(self, *args, **kwargs):
        before = len(self.cache)
        t = time.perf_counter()
        out = run(self, *args, **kwargs)
        if len(self.cache) != before:
            spent.append(time.perf_counter() - t)
            name = getattr(self.fn, "__name__", str(self.fn))
            chosen.setdefault(name, {}).update({str(k): str(v) for k, v in self.cache.items()})
        return out

    Autotuner.run = timed
    return spent, chosen


def _graph_timer() -> list:
    """Seconds of each Dynamo compile in this process, in order (Dynamo's compile callbacks)."""
    spent: list = []
    try:
        from torch._dynamo.callback import on_compile_end, on_compile_start
    except ImportError:  # a torch without Dynamo's compile callbacks: no per-graph seconds
        return spent
    began: list = []
    on_compile_start(lambda *_: began.append(time.perf_counter()))
    on_compile_end(lambda *_: spent.append(time.perf_counter() - began.pop()))
    return spent


def rank_main(shape: str) -> dict:
    import deepspeed
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    import hf_zero3
    from hf_zero3.testing import models, strict_zero3_config

    tuned, chosen = _autotune_timer()
    graph_s = _graph_timer()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = shape_config(shape)
    ds = strict_zero3_config(world_size=1, bf16=True)
    t = time.perf_counter()
    model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    build_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (BATCH, PROMPT), generator=g).to(dev)
    kw = dict(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed_call() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    first_call_s = timed_call()
    stats = engine.module.hf_zero3_last_generate
    metrics = {k: sum(v) for k, v in compilation_time_metrics.items()}
    first = dict(
        capture_s=stats.graph_capture_s,
        graphs=stats.compiles,
        graph_s=list(graph_s),
        loop=stats.loop,
        prefill=stats.prefill,
        step=stats.step,
        autotune_s=sum(tuned),
        autotuned_launches=len(tuned),
        autotune_chose=chosen,
    )
    second_call_s = timed_call()
    return dict(
        shape=shape,
        batch=BATCH,
        build_s=build_s,
        first_call_s=first_call_s,
        second_call_s=second_call_s,
        dynamo_s=metrics.get("_compile.compile_inner", 0.0),
        inductor_s=metrics.get("OutputGraph.call_user_compiler", 0.0),
        tracing_s=metrics.get("bytecode_tracing", 0.0),
        **first,
    )


def child(shape: str, phase: str, out: str) -> None:
    from hf_zero3.testing import run_ranks

    row = run_ranks(rank_main, 1, args=(shape,), backend="nccl", init="deepspeed", timeout=560, pg_timeout=120)[0]
    row["caches"] = phase
    with open(out, "w") as f:
        json.dump(row, f)


def main():
    import torch

    if not torch.cuda.is_available():
        print("bench_first_call needs a CUDA GPU; skipped")
        return
    rows = []
    where = os.environ.get("BENCH_CACHE_DIR")
    for shape in _asked:
        with tempfile.TemporaryDirectory(prefix=f"first_call_{shape}_", dir=where) as caches:
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                TRITON_CACHE_DIR=os.path.join(caches, "triton"),
            )
            for phase in ("cold", "warm"):
                out = os.path.join(caches, f"{phase}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", shape, phase, out]
                proc = subprocess.run(cmd, env=env, timeout=590)
                if proc.returncode != 0:
                    print(f"{shape} {phase}: the process exited {proc.returncode}; its row is missing", flush=True)
                    continue
                with open(out) as f:
                    rows.append(json.load(f))
                print("measured", rows[-1], flush=True)
    for r in rows:
        r["first_vs_second"] = r["first_call_s"] / r["second_call_s"]
    setup = dict(batch=BATCH, prompt=PROMPT, max_new_tokens=MAX_NEW, dtype="bf16", world=1, shapes=_asked)
    path = record("first_call", rows, HERE, setup)
    print(setup)
    cols = ["shape", "caches", "first_call_s", "second_call_s", "first_vs_second", "dynamo_s", "inductor_s"]
    print(table(rows, cols + ["tracing_s", "autotune_s", "capture_s", "graphs"]))
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
    else:
        main()
