"""Lockstep generation when ranks finish at different steps: transformers' ``synced_gpus``
(an all-reduce every step) against a fixed step count (DeepSpeed's own fix: always
``max_new_tokens`` steps) and hf_zero3's lockstep (stop agreements every 1/4/16 steps, per-layer
gathers; and gather-once: the whole model gathered for the call), for two length mixes.

Model: Llama-3.2-1B shape built in code (random weights, bf16) under strict ZeRO-3 (no
persistence, prefetch or reuse) on every GPU (up to 2; CPU/gloo with a tiny model if none). Each
rank generates ``BENCH_BATCH`` prompts of 32 tokens (default 4) for up to ``BENCH_MAX_NEW`` new
tokens (default 64); each row stops at a prescribed length through a rank-local stopping
criterion (as EOS would), so both mixes are exact:
  short:     every row stops after max_new_tokens/32 .. max_new_tokens/4 new tokens
  straggler: the same, but one row on rank 0 runs the full max_new_tokens
Measured: one generate() call, wall time on CUDA-synchronized clocks averaged over ranks;
tokens/s counts the rows' prescribed (useful) tokens on every rank. Ratios against the same run's
``synced_gpus``, ``fixed`` and ``sync4`` (per-layer gathers) rows.
Run: python benchmarks/generation/bench_generation.py
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import record, table, world_and_backend  # noqa: E402

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW", 64))
BATCH = int(os.environ.get("BENCH_BATCH", 4))
PROMPT = 32

CONFIGS = [  # name, how
    ("synced_gpus", dict(raw=True)),
    ("fixed", dict(stop="fixed", gather="layerwise")),
    ("sync1", dict(stop="sync", sync_every=1, gather="layerwise")),
    ("sync4", dict(stop="sync", sync_every=4, gather="layerwise")),
    ("sync16", dict(stop="sync", sync_every=16, gather="layerwise")),
    ("gather_once", dict(stop="sync", sync_every=4, gather="all")),
]


def _targets(mix: str, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    t = torch.randint(max(2, MAX_NEW // 32), MAX_NEW // 4 - MAX_NEW // 32 + 1, (BATCH,), generator=g)
    if mix == "straggler" and rank == 0:
        t[0] = MAX_NEW
    return t


def rank_main(small: bool):
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import StoppingCriteria, StoppingCriteriaList

    import hf_zero3
    from hf_zero3.testing import mark, models, strict_zero3_config

    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if small:
        cfg = models.tiny_llama_config(vocab_size=512, hidden_size=64, intermediate_size=128)
    else:
        cfg = models.llama_1b_shape_config()
    dtype = torch.bfloat16 if cuda else torch.float32
    ds = strict_zero3_config(world_size=dist.get_world_size(), bf16=cuda)
    mark("build model")
    t_build = time.perf_counter()
    model = models.zero3_model(cfg, ds, dtype=dtype)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    if rank == 0:
        print(f"model built in {time.perf_counter() - t_build:.1f}s", flush=True)
    module = engine.module
    counter = [0]
    module.register_forward_pre_hook(lambda m, a: counter.__setitem__(0, counter[0] + 1))

    class StopAt(StoppingCriteria):
        def __init__(self, targets):
            self.targets = targets.to(dev)

        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - PROMPT) >= self.targets

    rows = []
    for mix in ("short", "straggler"):
        targets = _targets(mix, rank)
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(3, cfg.vocab_size, (BATCH, PROMPT), generator=g).to(dev)
        kw = dict(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
        useful = int(targets.sum())
        for name, how in CONFIGS:
            for rep in range(2 if not rows else 1):  # the very first run warms up
                mark(f"{mix} {name} rep {rep}")
                crit = StoppingCriteriaList([StopAt(targets)])
                counter[0] = 0
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    if how.get("raw"):
                        module.generate(**kw, stopping_criteria=crit, synced_gpus=True)
                    else:
                        hf_zero3.lockstep_generate(engine, **kw, stopping_criteria=crit, **how)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
            tot = torch.tensor([useful, dt * 1e6], dtype=torch.float64, device=dev)
            dist.all_reduce(tot)
            rows.append(
                dict(
                    mix=mix,
                    config=name,
                    forwards=counter[0],
                    seconds=tot[1].item() / 1e6 / dist.get_world_size(),
                    useful_tokens=int(tot[0].item()),
                )
            )
            if rank == 0:
                print("measured", rows[-1], flush=True)
    return rows


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend()
    small = backend == "gloo"
    res = run_ranks(rank_main, world, args=(small,), backend=backend, init="deepspeed", timeout=560, pg_timeout=120)
    rows = res[0]
    for r in rows:
        r["tokens_per_s"] = r["useful_tokens"] / r["seconds"]
        r["forwards_rank1"] = next(
            x["forwards"] for x in res[-1] if x["mix"] == r["mix"] and x["config"] == r["config"]
        )
    for mix in ("short", "straggler"):
        base = {r["config"]: r for r in rows if r["mix"] == mix}
        for r in base.values():
            r["vs_synced_gpus"] = r["tokens_per_s"] / base["synced_gpus"]["tokens_per_s"]
            r["vs_fixed"] = r["tokens_per_s"] / base["fixed"]["tokens_per_s"]
            r["vs_sync4_layerwise"] = r["tokens_per_s"] / base["sync4"]["tokens_per_s"]
    setup = dict(
        world=world,
        backend=backend,
        model="tiny" if small else "llama-3.2-1b-shape",
        max_new_tokens=MAX_NEW,
        batch_per_rank=BATCH,
        prompt=PROMPT,
    )
    path = record("generation", rows, HERE, setup)
    print(setup)
    print(
        table(
            rows,
            [
                "mix",
                "config",
                "forwards",
                "forwards_rank1",
                "seconds",
                "tokens_per_s",
                "vs_synced_gpus",
                "vs_fixed",
                "vs_sync4_layerwise",
            ],
        )
    )
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
