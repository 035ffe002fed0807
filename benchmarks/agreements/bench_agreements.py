"""What hf_zero3's tagged agreements cost, next to the untagged all-reduce they replace, and their
share of a lockstep generate() call and of a training step.

Part 1, 2 gloo ranks on this host's loopback (where hf_zero3's agreements run, on a gloo mirror
of the gather group), median microseconds over ``BENCH_AGREE_CALLS`` calls (default 2000):
  raw      dist.all_reduce of the payload alone (an untagged agreement)
  tagged   hf_zero3.agree.agree: header digest + failure flag + payload in one fixed-size all-reduce
  recorded tagged, plus the c10d-store write of a call-level agreement
Part 2, one rank (the GPU when present, else a tiny model on CPU): a lockstep generate() call
(Llama-3.2-1B shape, bf16, batch 8, 64-token prompts, 128 new tokens, whole model gathered,
``sync_every=1``) and an eager ZeRO-3 training step (bs 1 x 512), each timed; the call's own
agreements are counted from its report, the step's are Zero3Safe's one per step plus the memory
plan's gate (two per step). share = agreements x (tagged - raw) / time (``tag_share_pct``), and
agreements x tagged / time for the whole cost (``agree_share_pct``).
Part 3, scaling: the stop agreement (one tagged value, as the decode loop's ``agree_unfinished``)
over ``BENCH_AGREE_WORLDS`` gloo processes on this host (default 2,4,8,16; fewer calls each as the
group grows), fitted to latency = a + b * log2(ranks) and to a + b * (ranks - 1) by least squares,
and the better fit's modelled overhead of one rollout at 8, 64 and 512 ranks for stop checks every
1, 2, 4 or 8 steps, on the current flags or late (on the previous check's flags, while the GPU
decodes: hf_zero3.generation.lockstep.stop_schedule), against a rollout of ``BENCH_ROLLOUT_S``
seconds (default 0.176: the 1B shape, batch 64, 128 new tokens on one H200, RESULTS.md) of 128
steps. Per rollout: 2 call-level agreements (the first: options, budget and gathering; the end)
and ceil(127 / every) stop checks; a check on the current flags waits out its agreement (the GPU idles), a late one only
what exceeds the ``every`` steps it overlaps (``exposed_ms``). A rollout that ends before its
budget also runs extra forwards past the group's last EOS, (every - 1) / 2 on average, plus
``every`` for a late check (``extra_ms``); ``overhead_pct`` counts both. Processes past the host's
cores share them, so the larger groups measure an upper bound. ``BENCH_AGREE_PARTS=scaling`` runs
part 3 alone, ``BENCH_AGREE_PARTS=latency`` part 1 alone (no GPU needed);
``BENCH_AGREE_FIT=<run>`` refits its model to the latencies a recorded run measured
(agreements.jsonl's ``run``) instead of measuring.
Run: python benchmarks/agreements/bench_agreements.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import load, record, table  # noqa: E402

CALLS = int(os.environ.get("BENCH_AGREE_CALLS", 2000))
WORLDS = [int(w) for w in os.environ.get("BENCH_AGREE_WORLDS", "2,4,8,16").split(",")]
ROLLOUT_S = float(os.environ.get("BENCH_ROLLOUT_S", 0.176))
PARTS = os.environ.get("BENCH_AGREE_PARTS", "all")
if PARTS not in ("all", "latency", "scaling"):
    raise SystemExit(f"BENCH_AGREE_PARTS takes all, latency or scaling, not {PARTS!r}")
#: (steps between stop checks, late) modelled in part 3; (1, False) was the default before late checks
SCHEDULES = ((1, False), (4, False), (8, False), (2, True), (4, True), (8, True))
CALL_AGREEMENTS = 2  # a generate() call's first (options, budget, gathering) and its end
FIT_RUN = os.environ.get("BENCH_AGREE_FIT")
LATENCIES = ("raw", "tagged", "recorded")  # part 1's columns (see the module docstring)
STEP_AGREEMENTS = 3  # Zero3Safe.on_step_begin + the gate's agree_launch for the forward and backward graph


def _latencies():
    import torch
    import torch.distributed as dist

    from hf_zero3.agree import Tag, agree, host_group

    group = host_group(None)
    out = {}
    for n_values in (1, 2):
        vals = list(range(n_values))
        for name, fn in (
            ("raw", lambda: dist.all_reduce(torch.tensor(vals, dtype=torch.int64), group=group)),
            ("tagged", lambda: agree(Tag("bench", {"stop": "sync"}, 1), None, vals)),
            ("recorded", lambda: agree(Tag("bench", {"stop": "sync"}, 1), None, vals, record=True)),
        ):
            out[f"{name}_{n_values}"] = _median_us(fn, CALLS, warmup=50)
    return out


def _median_us(fn, calls: int, warmup: int) -> float:
    """Median microseconds of ``calls`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def _stop_agreement_us(calls: int) -> float:
    """Median microseconds of the decode loop's stop agreement (one tagged value) on this group."""
    from hf_zero3.agree import Tag, agree

    return _median_us(lambda: agree(Tag("generate.step", {"stop": "sync"}, 1), None, [1]), calls, warmup=20)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / ss if ss else 1.0
    return a, b, r2


def _measure() -> list[dict]:
    """Part 3's measurement: the stop agreement's latency per world size, or (``BENCH_AGREE_FIT``,
    a run id of agreements.jsonl) the one a recorded run measured, to refit the model."""
    from hf_zero3.testing import run_ranks

    if FIT_RUN:
        rows = [r["result"] for r in load(os.path.join(HERE, "agreements.jsonl")) if r["run"] == FIT_RUN]
        measured = [r for r in rows if r.get("part") == "scaling"]
        if not measured:
            raise SystemExit(f"agreements.jsonl has no scaling rows of run {FIT_RUN!r}")
        return measured
    measured = []
    for world in WORLDS:
        calls = max(200, CALLS // max(1, world // 2))
        us = run_ranks(_stop_agreement_us, world, args=(calls,), timeout=900, pg_timeout=120)
        measured.append(
            {
                "ranks": world,
                "median_us": statistics.median(us),
                "max_rank_us": max(us),
                "calls": calls,
                "oversubscribed": world > (os.cpu_count() or 1),  # processes share cores: an upper bound
            }
        )
    return measured


def scaling() -> tuple[list[dict], list[dict]]:
    """Part 3: measured latency per world size, and the fitted model's rollout overhead."""
    import math

    measured = _measure()
    xs = [r["ranks"] for r in measured]
    ys = [r["max_rank_us"] for r in measured]
    fits = {
        "a + b log2(ranks)": (_fit([math.log2(x) for x in xs], ys), lambda n: math.log2(n)),
        "a + b (ranks - 1)": (_fit([x - 1 for x in xs], ys), lambda n: n - 1),
    }
    name = max(fits, key=lambda k: fits[k][0][2])
    (a, b, r2), shape = fits[name]
    model = []
    step_s = ROLLOUT_S / 128
    for ranks in (8, 64, 512):
        agree_s = (a + b * shape(ranks)) / 1e6
        for every, late in SCHEDULES:
            checks = math.ceil(127 / every)
            hidden = every * step_s if late else 0.0  # a late check overlaps the steps queued before it
            exposed = CALL_AGREEMENTS * agree_s + checks * max(0.0, agree_s - hidden)
            extra = ((every - 1) / 2 + (every if late else 0)) * step_s
            model.append(
                {
                    "ranks": ranks,
                    "sync_every": every,
                    "late": late,
                    "agreement_us": agree_s * 1e6,
                    "agreements": checks + CALL_AGREEMENTS,
                    "exposed_ms": exposed * 1e3,
                    "extra_ms": extra * 1e3,
                    "overhead_pct": 100 * (exposed + extra) / ROLLOUT_S,
                    "fit": f"{name}: a={a:.1f} us, b={b:.1f} us, R^2={r2:.3f}",
                }
            )
    return measured, model


def _gpu_times():
    import deepspeed
    import torch

    import hf_zero3
    from hf_zero3.testing import models

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = (
        models.llama_1b_shape_config()
        if cuda
        else models.tiny_llama_config(vocab_size=512, hidden_size=64, intermediate_size=128)
    )
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 1,
        "bf16": {"enabled": cuda},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": not cuda}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    models.ensure_deepspeed_comm()
    model = models.plain_model(cfg, dtype=dtype)
    if cuda:
        model.gradient_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    dev = engine.device
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompt = torch.randint(3, cfg.vocab_size, (8, 64), device=dev)
    hf_zero3.lockstep(engine, gather="all", sync_every=1)
    gen = dict(input_ids=prompt, max_new_tokens=128, min_new_tokens=128, pad_token_id=0, do_sample=False)
    calls = []
    for i in range(3):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            engine.module.generate(**gen)
        sync()
        calls.append(time.perf_counter() - t)
    stats = engine.module.hf_zero3_last_generate
    engine.train()
    steps = []
    for i in range(4):
        ids = torch.randint(3, cfg.vocab_size, (1, 512), device=dev)
        sync()
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync()
        steps.append(time.perf_counter() - t)
    return dict(
        generate_s=min(calls[1:]),
        generate_agreements=stats.agreements + 1,  # + the gather decision
        step_s=min(steps[1:]),
        device="cuda" if cuda else "cpu",
    )


def main():
    from hf_zero3.testing import run_ranks

    measured, model = scaling() if PARTS in ("all", "scaling") else ([], [])
    if measured:
        print(table(measured, ["ranks", "median_us", "max_rank_us", "calls", "oversubscribed"]))
        if any(r["oversubscribed"] for r in measured):
            print(f"more processes than this host's {os.cpu_count()} cores: those rows, and the fit, are upper bounds")
        print(model[0]["fit"])
        print(
            table(
                model,
                ["ranks", "sync_every", "late", "agreement_us", "agreements", "exposed_ms", "extra_ms", "overhead_pct"],
            )
        )
        for r in measured:
            r["part"] = "scaling"
        for r in model:
            r["part"] = "model"
        setup = {"worlds": WORLDS, "backend": "gloo", "rollout_s": ROLLOUT_S, "calls": CALLS, "cores": os.cpu_count()}
        if FIT_RUN:  # the latencies are the recorded run's: only the model is new
            measured, setup = [], {"fitted_to_run": FIT_RUN, "rollout_s": ROLLOUT_S}
        print(f"raw rows appended to {record('agreements', measured + model, HERE, setup)}")
    if PARTS == "scaling":
        return
    lat = run_ranks(_latencies, 2, timeout=600, pg_timeout=60)[0]
    rows = [
        {"what": f"one agreement ({n} value{'s' if n > 1 else ''})", **{f"{k}_us": lat[f"{k}_{n}"] for k in LATENCIES}}
        for n in (1, 2)
    ]
    print(table(rows, ["what", "raw_us", "tagged_us", "recorded_us"]))
    for r in rows:
        r["part"] = "latency"
    setup = {"latency_ranks": 2, "latency_backend": "gloo", "calls": CALLS, "cores": os.cpu_count()}
    if PARTS == "latency":
        print(f"raw rows appended to {record('agreements', rows, HERE, setup)}")
        return
    times = run_ranks(
        _gpu_times, 1, backend="nccl" if _cuda() else "gloo", init="deepspeed", timeout=600, pg_timeout=120
    )[0]
    extra = lat["tagged_1"] - lat["raw_1"]
    shares = [
        {
            "call": f"generate 8x128 ({times['device']})",
            "seconds": times["generate_s"],
            "agreements": times["generate_agreements"],
            "tag_share_pct": 100 * times["generate_agreements"] * extra / 1e6 / times["generate_s"],
            "agree_share_pct": 100 * times["generate_agreements"] * lat["tagged_1"] / 1e6 / times["generate_s"],
        },
        {
            "call": f"train step bs1x512 eager ZeRO-3 ({times['device']})",
            "seconds": times["step_s"],
            "agreements": STEP_AGREEMENTS,
            "tag_share_pct": 100 * STEP_AGREEMENTS * extra / 1e6 / times["step_s"],
            "agree_share_pct": 100 * STEP_AGREEMENTS * lat["tagged_1"] / 1e6 / times["step_s"],
        },
    ]
    print(table(shares, ["call", "seconds", "agreements", "tag_share_pct", "agree_share_pct"]))
    for r in shares:
        r["part"] = "share"
    path = record(
        "agreements",
        rows + shares,
        HERE,
        {**setup, "device": times["device"]},
    )
    print(f"raw rows appended to {path}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
