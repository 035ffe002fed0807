"""DeepCompile memory and speed: plain ZeRO-3 vs DeepCompile (zero3 pass only, DeepSpeed's
default schedule) vs hf_zero3's memory plan (``ours``: budget mode, the default; ``ours_match``:
match_zero3; ``ours_split``: budget with prefetch coalescing off), uncapped and capped per process.

Model: Llama-3.2-1B shape built in code (16 layers, hidden 2048, intermediate 8192, 32 heads / 8
KV, vocab 128256, tied embeddings), batch 1 x 512 tokens, activation checkpointing, bf16, AdamW,
ZeRO-3 with DeepSpeed's default settings, every GPU (up to 2) a rank. Per step: forward +
``engine.backward`` + ``engine.step``, CUDA-synchronized wall time, ``max_memory_allocated`` /
``max_memory_reserved`` (peak reset each step), cudaMalloc retries. Step time: the median of the
later steps; compile time: the extra time of the steps above 3x the median. DeepSpeed's default
schedule runs the zero3 pass alone for steps 0-4 and adds prefetch + selective gather at step 5
(a second compile), so one ``dc_default`` cell gives both DeepCompile rows (zero3-only: its steps
1-4; default: its steps 6+). Ratios (``speed_vs_*``, ``peak_vs_*``) are against the same
invocation's plain ZeRO-3 and default-schedule rows of the same cell; none without them.

Run (GPU):  python benchmarks/memory/bench_memory.py [--cap GIB ...] [--settings a,b] [--steps N]
            [--optim torch,fused] [--build zero_init,plain] [--ckpt nonreentrant,default] [--jobs N]
Each cell (setting, cap, optimizer, construction, checkpointing) runs in fresh processes. The
axes: ``--optim torch`` is ``torch_adam``, ``fused`` DeepSpeed's default (fused CUDA) AdamW;
``--build zero_init`` builds under ``deepspeed.zero.Init``, ``plain`` builds
``LlamaForCausalLM(config)`` in fp32 and hands it to ``deepspeed.initialize``; ``--ckpt
nonreentrant`` asks transformers for non-reentrant checkpointing, ``default`` calls
``gradient_checkpointing_enable()`` with transformers' defaults. ``--jobs N`` runs N cells at
once on the same GPUs: peaks and OOMs stay exact per process, step times are then only comparable
within the run (each row says how many ran together). BENCH_LAYERS=4 shrinks the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import record, scratch_dir, table, world_and_backend  # noqa: E402

SETTINGS = ("plain", "dc_default", "ours", "ours_match")  # dc_default also yields the zero3-only row
AXES = ("optim", "build", "ckpt")
LABEL = {
    "plain": "plain ZeRO-3 (eager)",
    "dc_zero3": "DeepCompile zero3 pass only",
    "dc_default": "DeepCompile default schedule",
    "ours": "hf_zero3 plan (budget)",
    "ours_match": "hf_zero3 plan (match_zero3)",
    "ours_split": "hf_zero3 plan (budget, coalesce off)",
}
SEQ = 512


def model_config():
    from hf_zero3.testing import llama_1b_shape_config

    return llama_1b_shape_config(num_hidden_layers=int(os.environ.get("BENCH_LAYERS", 16)))


def _cell(setting, cap_gib, optim="torch", build="zero_init", ckpt="nonreentrant") -> str:
    return f"{setting}_{cap_gib}_{optim}_{build}_{ckpt}"


def rank_main(
    setting: str,
    cap_gib: float,
    steps: int,
    progress: str,
    optim: str = "torch",
    build: str = "zero_init",
    ckpt: str = "nonreentrant",
):
    import deepspeed
    import torch
    import torch.distributed as dist

    from hf_zero3.testing import mark, models

    rank = dist.get_rank()  # run_ranks pinned this rank to its GPU and started DeepSpeed's comm
    if cap_gib:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, **({"torch_adam": True} if optim == "torch" else {})}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if setting != "plain":
        ds["compile"] = {"deepcompile": True}
    mark("build")
    if build == "plain":  # as a user writes it: no zero.Init, fp32 on the host, DeepSpeed casts and partitions
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config())
    else:
        model = models.zero3_model(model_config(), ds, seed=0, dtype=torch.bfloat16)
    if ckpt == "default":
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    planner = None
    if setting == "dc_zero3":
        engine.compile(schedule=[(0, ["zero3_compile"])])
    elif setting == "dc_default":
        engine.compile()
    elif setting in ("ours", "ours_match", "ours_split"):
        from hf_zero3.compile import MemoryPlanConfig
        from hf_zero3.compile.gate import reset_counters
        from hf_zero3.compile.memory_plan import compile_with_memory_plan

        reset_counters()
        planner = compile_with_memory_plan(
            engine,
            MemoryPlanConfig(
                mode="match_zero3" if setting == "ours_match" else "budget", coalesce=setting != "ours_split"
            ),
        )
    rec = {
        "setting": setting,
        "cap_gib": cap_gib,
        "optim": optim,
        "build": build,
        "ckpt": ckpt,
        "steps": [],
        "error": None,
    }
    path = os.path.join(progress, f"{_cell(setting, cap_gib, optim, build, ckpt)}_rank{rank}.json")

    def flush():
        with open(path, "w") as f:
            json.dump(rec, f)

    vocab = model.config.vocab_size
    for step in range(steps):
        mark(f"step {step}")
        g = torch.Generator().manual_seed(step * 100 + rank)
        ids = torch.randint(3, vocab, (1, SEQ), generator=g).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        phase = "forward"
        try:
            loss = engine(input_ids=ids, labels=ids).loss
            phase = "backward"
            engine.backward(loss)
            phase = "optimizer step"
            engine.step()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            msg = str(exc).splitlines()[0]
            rec["error"] = (
                f"OOM at step {step} ({phase}): {msg[: msg.find('. GPU') + 1 or None]} "
                f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved() / 2**30:.2f} reserved"
            )
            flush()
            os._exit(3)  # peers fail in their next collective; the parent reads this file
        rec["steps"].append(
            {
                "t": time.perf_counter() - t,
                "loss": float(loss.item()),
                "alloc": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved(),
                # cudaMalloc retries after freeing the cache: the cost of running at a cap
                "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            }
        )
        flush()
    if planner is not None:
        from hf_zero3.compile.gate import counters

        rec["gate"] = counters()
        rec["plan"] = planner.summary()
        rec["calibration"] = [list(h) for h in planner.calibration.history]
    flush()
    return rec


def summarize(rec: dict, status: str) -> list[dict]:
    """One row; DeepSpeed's default-schedule run gives two: its steps 1-4 run the zero3 pass only
    (the schedule adds prefetch + selective_gather at step 5), its steps 6+ the full schedule."""
    steps = rec.get("steps", [])
    if rec["setting"] == "dc_default":
        zero3 = dict(rec, setting="dc_zero3", steps=steps[:5], gate=None, plan=None)
        full = dict(rec, steps=steps[5:], compile_first=steps[:1])
        return [_row(zero3, "trained" if len(steps) >= 5 else status, tail_from=1), _row(full, status, tail_from=1)]
    return [_row(rec, status)]


def _row(rec: dict, status: str, tail_from: int | None = None) -> dict:
    steps = rec.get("steps", [])
    row = {
        "setting": LABEL[rec["setting"]],
        "cap_gib": rec["cap_gib"] or "none",
        "status": status,
        "steps_done": len(steps),
    }
    row.update({a: rec.get(a, d) for a, d in zip(AXES, ("torch", "zero_init", "nonreentrant"))})
    if steps:
        tail = steps[tail_from:] if tail_from is not None and len(steps) > tail_from else steps[len(steps) // 2 :]
        med = statistics.median(s["t"] for s in tail)
        row.update(
            peak_alloc_gib=max(s["alloc"] for s in steps) / 2**30,
            peak_reserved_gib=max(s["reserved"] for s in steps) / 2**30,
            median_step_s=med,
            compile_s=sum(s["t"] - med for s in steps + rec.get("compile_first", []) if s["t"] > 3 * med),
            final_loss=steps[-1]["loss"],
            alloc_retries=steps[-1].get("alloc_retries"),
        )
    gate = rec.get("gate")
    if gate:
        row.update(prefetch_issued=gate["issued"], prefetch_deferred=gate["deferred"])
    plan = rec.get("plan")
    if plan:
        row.update(
            planned=f"{plan['prefetched']}/{plan['gathers']}",
            slots=plan["slots"],
            persistent=plan["persistent"],
            budget_gib=plan["budget"] / 2**30,
            calibrated=plan.get("calibrated"),
            gate_tighten_gib=plan.get("gate_tighten", 0) / 2**30,
        )
    return row


def main():
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    from hf_zero3.testing import DistributedFailure, run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=float, nargs="*", default=[0.0, 16.0], help="GiB per process, 0 = uncapped")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--optim", default="torch", help="torch (torch_adam) and/or fused (DeepSpeed's default AdamW)")
    ap.add_argument("--build", default="zero_init", help="zero_init and/or plain (LlamaForCausalLM(config))")
    ap.add_argument("--ckpt", default="nonreentrant", help="nonreentrant and/or default (transformers' defaults)")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once on the same GPUs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=420, help="seconds per cell")
    args = ap.parse_args()
    world, backend = world_and_backend()
    if backend != "nccl":
        print("bench_memory needs CUDA GPUs (DeepCompile is CUDA-only); skipped")
        return
    progress = os.path.join(scratch_dir(), "memory_progress")
    os.makedirs(progress, exist_ok=True)
    cells = list(
        itertools.product(
            args.cap, args.optim.split(","), args.build.split(","), args.ckpt.split(","), args.settings.split(",")
        )
    )

    def run_cell(cell):
        cap, optim, build, ckpt, setting = cell
        t0 = time.time()
        status = "trained"
        rec_path = os.path.join(progress, f"{_cell(setting, cap, optim, build, ckpt)}_rank0.json")
        if os.path.exists(rec_path):  # an earlier invocation's record of this cell
            os.remove(rec_path)
        try:
            run_ranks(
                rank_main,
                world,
                args=(setting, cap, args.steps, progress, optim, build, ckpt),
                backend=backend,
                init="deepspeed",
                timeout=args.timeout,
                pg_timeout=60,
            )
        except DistributedFailure as exc:
            status = "failed"
            print(str(exc)[-3000:], flush=True)
        rec = (
            json.load(open(rec_path))
            if os.path.exists(rec_path)
            else {"setting": setting, "cap_gib": cap, "optim": optim, "build": build, "ckpt": ckpt}
        )
        if rec.get("error"):
            status = rec["error"]
        out = []
        for row in summarize(rec, status):
            row["wall_s"], row["concurrent_jobs"] = time.time() - t0, args.jobs
            out.append(row)
            print(json.dumps(row), flush=True)
        return out

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = [r for rs in pool.map(run_cell, cells) for r in rs]

    def key(r):
        return (r["cap_gib"], r.get("optim", "torch"), r.get("build", "zero_init"), r.get("ckpt", "nonreentrant"))

    # ratios against this invocation's baselines of the same cell only (hosts differ by +-20 % in step time)
    plain = {key(r): r for r in rows if r["setting"] == LABEL["plain"] and r.get("median_step_s")}
    default = {key(r): r for r in rows if r["setting"] == LABEL["dc_default"] and r.get("median_step_s")}
    for r in rows:
        if "median_step_s" in r:
            if key(r) in plain:
                r["speed_vs_plain"] = plain[key(r)]["median_step_s"] / r["median_step_s"]
                r["peak_vs_plain"] = r["peak_alloc_gib"] / plain[key(r)]["peak_alloc_gib"]
            if key(r) in default:
                r["speed_vs_default"] = default[key(r)]["median_step_s"] / r["median_step_s"]
                r["peak_vs_default"] = r["peak_alloc_gib"] / default[key(r)]["peak_alloc_gib"]
    setup = {
        "world": world,
        "model": "llama-3.2-1b-shape",
        "layers": model_config().num_hidden_layers,
        "seq": SEQ,
        "micro_batch": 1,
        "steps": args.steps,
        "jobs": args.jobs,
    }
    path = record("memory", rows, HERE, setup)
    print(
        table(
            rows,
            [
                "setting",
                "cap_gib",
                "optim",
                "build",
                "ckpt",
                "status",
                "peak_alloc_gib",
                "peak_reserved_gib",
                "median_step_s",
                "compile_s",
                "alloc_retries",
                "prefetch_deferred",
                "planned",
                "persistent",
                "gate_tighten_gib",
                "speed_vs_plain",
                "speed_vs_default",
                "peak_vs_plain",
                "peak_vs_default",
            ],
        )
    )
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
