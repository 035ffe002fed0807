"""Eval under DeepCompile ZeRO-3: the time of an eval pass through hf_zero3's gather-all and
layer-wise paths, against plain ZeRO-3 eager eval through DeepSpeed's hooks (the baseline:
DeepCompile's own eval path fails, see tests/gpu).

Model: a 4-layer Llama (hidden 1024, intermediate 2816, GQA 16/8, vocab 32000, SDPA), bf16,
ZeRO-3 with DeepSpeed's default settings on every GPU (up to 2); 6 training steps first, then 16
eval batches of 2 x 128 tokens under ``no_grad``, the second of two repetitions timed. Peak: the
process's ``max_memory_allocated`` after the engine's rows.
Run: python benchmarks/eval/bench_eval.py  (GPU only)
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import record, table, world_and_backend  # noqa: E402

BATCHES = 16


def rank_main():
    import torch
    from _deepcompile_workers import batch, build, train_steps

    import hf_zero3
    from hf_zero3.testing import mark

    rows = []
    for label, deepcompile in (("plain ZeRO-3 eager", False), ("DeepCompile", True)):
        mark(f"build {label}")
        engine = build(deepcompile=deepcompile, compile_=deepcompile)
        train_steps(engine, 6)
        engine.eval()
        modes = ("all", "layerwise") if deepcompile else ("none", "all")
        for mode in modes:
            for rep in range(2):
                mark(f"{label} eval {mode} rep {rep}")
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    if mode == "none":
                        for b in range(BATCHES):
                            engine(input_ids=batch(b, 0, engine.device))
                    else:
                        with hf_zero3.eval_forward(engine, gather=mode):
                            for b in range(BATCHES):
                                engine(input_ids=batch(b, 0, engine.device))
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
            rows.append(
                dict(
                    engine=label,
                    path="DeepSpeed hooks" if mode == "none" else mode,
                    seconds=dt,
                    batches=BATCHES,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                )
            )
        del engine
        torch.cuda.empty_cache()
    return rows


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend()
    if backend != "nccl":
        print("bench_eval needs a CUDA GPU (DeepCompile is CUDA-only); skipped")
        return
    rows = run_ranks(rank_main, world, backend=backend, init="deepspeed", timeout=560, pg_timeout=120)[0]
    base = rows[0]["seconds"]
    for r in rows:
        r["vs_plain_zero3"] = base / r["seconds"]
    path = record("eval", rows, HERE, {"world": world, "batches": BATCHES, "tokens_per_batch": "2x128"})
    print(table(rows, ["engine", "path", "batches", "seconds", "vs_plain_zero3", "peak_gib"]))
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
