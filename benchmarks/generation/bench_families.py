"""Rollout decode speed per model family with the whole model gathered, one GPU, same run: the
families beyond dense Llama (MoE, sliding windows that slide, Phi-3, a hybrid linear-attention
model) through hf_zero3's static loop against the two ways a ZeRO-3 rollout decodes without it.

Rows per family (``config``):
  hf_eager_gathered    TRL's path: the whole model gathered, ZeRO-3's hooks off
                       (``hf_zero3.eval_forward(gather="all")``), transformers' eager ``generate``.
  hf_static_gathered   the same with transformers' static cache (``cache_implementation="static"``:
                       its own compiled decode step, its per-token Python loop).
  hf_zero3             ``hf_zero3.lockstep_generate(decode="compiled")`` at the library's defaults.
  hf_zero3_batched_mm  (MoE only) the same with transformers' ``batched_mm`` experts (a gathered
                       weight copy per token and expert) instead of its default ``grouped_mm``
                       (tokens sorted by expert, one grouped GEMM): which expert computation pays.

Families (``BENCH_FAMILIES``, comma-separated; default all), random weights, bf16, SDPA:
  qwen3_moe   Qwen3-30B-A3B's sizes (128 experts of width 768, top-8), ``BENCH_MOE_LAYERS`` layers (8)
  gemma3_1b   Gemma-3-1B's sizes, a 512-token window on five layers of six, ``BENCH_GEMMA_NEW`` new tokens (1024)
  phi3_mini   Phi-3-mini's sizes (no GQA), its own ``prepare_inputs_for_generation``
  qwen3_5     a Qwen3.5-shaped hybrid (three gated-delta-rule layers to one attention layer),
              ``BENCH_QWEN35_LAYERS`` layers (16)
Batch ``BENCH_BATCH`` (64) of 64-token prompts, ``BENCH_MAX_NEW`` new tokens (128), greedy, no
EOS (every configuration runs the same forwards). Each configuration runs once to compile, then
``BENCH_REPS`` times (2); ``seconds`` is the median. ``agree``: the mean over rows of the share of
new tokens equal to HF eager's before the first difference (bf16: argmax ties and rounding part
them sooner or later). ``floor_s``: the weights a decode step reads, at ``BENCH_HBM_TBPS`` (default
by the GPU's name: 3.35 for an H100, 4.3 for an H200 as in bench_decode), times the steps; for
MoE only the experts a step's routing reaches (E(1 - (1 - k/E)^B) of E per layer for B tokens of
top-k, uniform routing); ``fraction_of_floor`` is floor_s / seconds. ``floor_kv_s`` adds the KV
cache a step reads on average (each attention layer's filled positions, a sliding layer's at most
its window): at batch 64 without GQA (Phi-3) that is as much as half the weights.
A configuration that runs out of memory is a row with its ``error``.
Run: python benchmarks/generation/bench_families.py   (GPU only)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import hbm_tbps, record, scratch_dir, table, world_and_backend  # noqa: E402

BATCH = int(os.environ.get("BENCH_BATCH", 64))
MAX_NEW = int(os.environ.get("BENCH_MAX_NEW", 128))
REPS = int(os.environ.get("BENCH_REPS", 2))
PROMPT = 64
FAMILIES = {
    "qwen3_moe": ("qwen3_moe_shape_config", {"num_hidden_layers": int(os.environ.get("BENCH_MOE_LAYERS", 8))}),
    "gemma3_1b": ("gemma3_1b_shape_config", {}),
    "phi3_mini": ("phi3_mini_shape_config", {}),
    "qwen3_5": ("qwen3_5_shape_config", {"num_hidden_layers": int(os.environ.get("BENCH_QWEN35_LAYERS", 16))}),
}
NEW = {"gemma3_1b": int(os.environ.get("BENCH_GEMMA_NEW", 1024))}
_asked = [f for f in os.environ.get("BENCH_FAMILIES", ",".join(FAMILIES)).split(",") if f]
_unknown = sorted(set(_asked) - set(FAMILIES))
if _unknown:
    raise SystemExit(f"BENCH_FAMILIES names unknown families {_unknown}; known: {', '.join(FAMILIES)}")
CONFIGS = [c for c in os.environ.get("BENCH_CONFIGS", "hf_eager_gathered,hf_static_gathered,hf_zero3").split(",") if c]


def _hbm_tbps(device) -> float:
    import torch

    return hbm_tbps(torch.cuda.get_device_name(device))


def _expert_bytes(module) -> tuple[int, int, int, int]:
    """(bytes of the experts' weights, of everything else, experts per layer, top-k) of ``module``."""
    experts, other, per_layer, k = 0, 0, 0, 0
    for name, p in module.named_parameters():
        n = p.ds_numel * 2
        if ".experts." in name:
            experts += n
        else:
            other += n
    cfg = module.config
    per_layer = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    k = getattr(cfg, "num_experts_per_tok", 0) or 0
    return experts, other, per_layer, k


def _kv_bytes(config, new: int) -> float:
    """Bytes of KV cache a decode step reads on average over ``new`` steps after the prompt: every
    attention layer's filled positions (a sliding layer's at most its window), keys and values in
    bf16; linear-attention layers' states are counted as weights are not (small)."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    total = 0.0
    for kind in kinds:
        if kind not in ("full_attention", "sliding_attention"):
            continue
        lengths = [PROMPT + i + 1 for i in range(new)]
        if kind == "sliding_attention" and window:
            lengths = [min(n, window) for n in lengths]
        total += 2 * heads * dim * 2 * BATCH * sum(lengths) / new
    return total


def rank_main(partial: str):
    import deepspeed
    import torch

    import hf_zero3
    from hf_zero3.testing import mark, models, strict_zero3_config

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for family in _asked:
        fn, overrides = FAMILIES[family]
        new = NEW.get(family, MAX_NEW)
        cfg = getattr(models, fn)(**overrides)
        ds = strict_zero3_config(world_size=1, bf16=True)
        ds.pop("optimizer")  # a rollout's speed: no optimizer states to hold
        mark(f"{family}: build")
        model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
        engine, *_ = deepspeed.initialize(model=model, config=ds)
        engine.eval()
        module = engine.module
        experts, other, per_layer, k = _expert_bytes(module)
        hit = per_layer * (1 - (1 - k / per_layer) ** BATCH) if per_layer else 0
        step_bytes = other + (experts * hit / per_layer if per_layer else experts)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, cfg.vocab_size, (BATCH, PROMPT), generator=g).to(dev)
        configs = list(CONFIGS) + (["hf_zero3_batched_mm"] if per_layer and "hf_zero3" in CONFIGS else [])
        reference = None
        for name in configs:
            experts_impl = "batched_mm" if name == "hf_zero3_batched_mm" else None
            before = module.config._experts_implementation if experts_impl else None
            if experts_impl:
                module.set_experts_implementation(experts_impl)
            times, stats, out, error = [], None, None, None
            hf_zero3.release_decode_graphs(module)
            try:
                for rep in range(1 + REPS):
                    mark(f"{family} {name} rep {rep}")
                    kw = dict(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    with torch.no_grad():
                        if name.startswith("hf_zero3"):
                            out = hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", **kw)
                            stats = module.hf_zero3_last_generate
                        else:
                            extra = {"cache_implementation": "static"} if name == "hf_static_gathered" else {}
                            with hf_zero3.eval_forward(engine, gather="all"):
                                out = module.generate(**kw, **extra)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
            except torch.OutOfMemoryError as exc:  # a row that cannot run at this size says so
                error = f"out of memory: {str(exc).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
            finally:
                if experts_impl:
                    module.set_experts_implementation(before)
            if error is not None:
                row = dict(family=family, config=name, batch=BATCH, new_tokens=new, error=error, seconds=float("nan"))
                rows.append(row)
                print("measured", row, flush=True)
                continue
            gen = out[:, PROMPT:].cpu()
            if name == "hf_eager_gathered":
                reference = gen
            agree = None
            if reference is not None:
                same = (gen == reference).int()
                first_diff = torch.where(same.all(1), new, (1 - same).argmax(1))
                agree = float(first_diff.float().mean() / new)
            median = statistics.median(times[1:])
            report = getattr(stats, "decode_report", None)
            row = dict(
                family=family,
                config=name,
                batch=BATCH,
                new_tokens=new,
                seconds=median,
                seconds_all=times[1:],
                first_call_s=times[0],
                loop=getattr(stats, "loop", None),
                loop_reason=getattr(stats, "loop_reason", None),
                step=getattr(stats, "step", None),
                graph_steps=getattr(stats, "graph_steps", None),
                experts=getattr(report, "experts", None) if report is not None else None,
                ring_layers=getattr(report, "ring_layers", None),
                linear_attention_layers=getattr(report, "linear_attention_layers", None),
                attention=getattr(report, "attention", None),
                agree=agree,
                step_bytes=step_bytes,
                experts_hit_per_layer=hit,
                floor_s=new * step_bytes / (_hbm_tbps(dev) * 1e12),
                floor_kv_s=new * (step_bytes + _kv_bytes(cfg, new)) / (_hbm_tbps(dev) * 1e12),
                mlp_kernels=getattr(report, "mlp_kernels", None),
                split_k=getattr(report, "split_k", None),
                fused_projections=getattr(report, "fused_projections", None),
            )
            rows.append(row)
            print("measured", row, flush=True)
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")
        engine.destroy()
        del engine, model, module
        torch.cuda.empty_cache()
    return rows


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend(max_gpus=1)
    if backend != "nccl":
        print("bench_families needs a CUDA GPU; skipped")
        return
    partial = os.path.join(scratch_dir(), "families_partial.jsonl")
    if os.path.exists(partial):
        os.remove(partial)
    timeout = float(os.environ.get("BENCH_TIMEOUT", 580))
    rows = run_ranks(rank_main, 1, args=(partial,), backend=backend, init="deepspeed", timeout=timeout, capture=False)[
        0
    ]
    for r in rows:
        if "error" in r:
            continue
        r["fraction_of_floor"] = r["floor_s"] / r["seconds"]
        r["fraction_of_floor_kv"] = r["floor_kv_s"] / r["seconds"]
        base = {x["config"]: x for x in rows if x["family"] == r["family"]}
        for b in ("hf_eager_gathered", "hf_static_gathered"):
            if b in base and "error" not in base[b]:
                r[f"vs_{b}"] = base[b]["seconds"] / r["seconds"]
    setup = dict(batch=BATCH, prompt=PROMPT, max_new_tokens=MAX_NEW, reps=REPS, families=_asked, dtype="bf16")
    path = record("families", rows, HERE, setup)
    print(setup)
    print(
        table(
            rows,
            [
                "family",
                "config",
                "new_tokens",
                "seconds",
                "vs_hf_eager_gathered",
                "vs_hf_static_gathered",
                "fraction_of_floor",
                "fraction_of_floor_kv",
                "loop",
                "step",
                "agree",
            ],
        )
    )
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
