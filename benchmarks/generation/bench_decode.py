"""Rollout decode speed with the whole model gathered: hf_zero3's compiled static decode loop
against the ways a ZeRO-3 rollout decodes without it, same run, batch 8 and 64, 128 new tokens.

Rows (``config``):
  hf_eager_gathered    TRL's ``unwrap_model_for_generation`` + ``generate``: all parameters
                       gathered, ZeRO-3's hooks off (here ``hf_zero3.eval_forward(gather="all")``),
                       transformers' eager decode. The baseline of ``vs_hf_eager_gathered``.
  hf_static_gathered   the same with transformers' static cache (``cache_implementation="static"``,
                       its own compiled decode step). The baseline of ``vs_hf_static``.
  hf_zero3_graphs      ``hf_zero3.lockstep_generate(decode="compiled")`` at the library's defaults:
                       the static loop, CUDA graphs of 8 steps, a stop agreement every 8 steps.
  hf_zero3_*           one row per switch that differs from the defaults (``OURS`` below: graphs of
                       1 step or none, q/k/v unfused, the PyTorch or always the Triton attention,
                       cuBLAS for the MLP / down / o_proj / q/k/v, eager prompt
                       forward, eager prompt forward and decode step (a TRL rollout's
                       defaults), one compiled decoder layer for every layer, the fused rotary +
                       cache write on/off, dependent launches off, ``sync_every=1``).
  layerwise            lockstep with per-layer gathers (ZeRO-3's hooks live).
``BENCH_CONFIGS`` (comma-separated names, or ``all``; default the first three) picks the rows; a
name given twice is measured twice (the second row's name gets ``#2``): the host's drift within one
process. The ratio columns need both HF rows in the run.

``agree``: the mean over rows of the share of new tokens equal to the first configuration's
(``agree_with``; HF eager's by default) before the first difference (bf16 on random weights: near
ties part them; transformers' static cache parts from eager as soon).

Rows end at rank-dependent lengths: ``useful_tokens`` counts each row up to its own target length
(drawn per rank, row 0 of rank 0 runs all 128), and every configuration runs the 128 decode
forwards that such a group runs, without EOS. (A Python stopping criterion would move every
configuration onto transformers' loop, so the lengths are applied in the count, not in the loop.)

Model: Llama-3.2-1B shape in code (``BENCH_SHAPE``: ``llama-1b``, ``llama-8b``, ``qwen2-0.5b``;
random weights, bf16) under ZeRO-3 on every GPU (up to 2; with DeepSpeed's AdamW, whose fp32 states
do not fit the 8B shape on one 80 GB card: ``BENCH_OPTIMIZER=none`` leaves it out), 64
-token prompts (``BENCH_PROMPTS=padded``: left-padded prompts of 32-64 tokens with their attention
mask, as a chat template's prompts reach a rollout; ``fixed,padded``: both, one after the other per
batch in one process, each compared with its own baselines), greedy. Each configuration runs once to
compile, then ``BENCH_REPS`` more times
(default 5; HF eager and layer-wise, which take seconds, once); ``seconds`` is the median of
those (a repeated rollout: the static loop replays the CUDA graphs its first call captured,
``graphs_reused``), ``seconds_all`` every one (``capture_s_all``: host seconds each spent capturing
graphs: the first timed call of a static-loop row captures again, so the median of five is used);
the first call's extra time over the median is ``compile_s``, its whole time ``first_call_s``
(``BENCH_COMPILE_TIMES=1`` prints where Dynamo and inductor spent it).
``floor_tok_s``: batch / (bf16 weight bytes / HBM bandwidth), the tokens/s of a decode step that
only streams the weights once (``BENCH_HBM_TBPS``, default by the GPU: an H100's 3.35 TB/s, else an
H200's 4.3); ``fraction_of_floor``
counts every row of every step (``step_tokens_per_s``), as the floor does; ``tokens_per_s`` and
the ``vs_*`` ratios count each row up to its own length.
Run: python benchmarks/generation/bench_decode.py   (GPU only; BENCH_BATCHES=8,64)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import (  # noqa: E402
    SHAPES,
    hbm_tbps,
    record,
    scratch_dir,
    set_switches,
    shape_config,
    table,
    world_and_backend,
)

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW", 128))
REPS = int(os.environ.get("BENCH_REPS", 5))  # timed calls after the compiling one
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "8,64").split(",")]
PROMPT = 64
# "fixed": every row a PROMPT-token prompt; "padded": left-padded prompts of PROMPT/2..PROMPT tokens
# with their attention mask, as a chat template's prompts reach a rollout (a padding mask also
# selects another attention kernel for the prompt forward)
SHAPE = os.environ.get("BENCH_SHAPE", "llama-1b")
if SHAPE not in SHAPES:
    raise SystemExit(f"BENCH_SHAPE takes one of {', '.join(SHAPES)}, not {SHAPE!r}")
# 1: every call of a static-loop row decodes with a new loop and captures its graphs anew, as a
# GRPO rollout does when the training step between two rollouts moved the cache's allocation
RECAPTURE = os.environ.get("BENCH_RECAPTURE") == "1"
OPTIMIZER = os.environ.get("BENCH_OPTIMIZER", "adamw") != "none"
PROMPTS = os.environ.get("BENCH_PROMPTS", "fixed").split(",")  # "fixed,padded": both, in one process
if not PROMPTS or set(PROMPTS) - {"fixed", "padded"}:
    raise SystemExit(f"BENCH_PROMPTS takes fixed, padded or both (comma-separated), not {','.join(PROMPTS)!r}")
# hf_zero3 rows: name -> (graph_steps, sync_every, switches set for the row); every other
# HF_ZERO3_* switch is unset, so it runs at the library's default
_ON, _OFF = "1", "0"
_EAGER = {"HF_ZERO3_COMPILE_PREFILL": _OFF, "HF_ZERO3_COMPILE_STEP": _OFF}  # a TRL rollout's step and prompt forward
OURS = {
    "hf_zero3_static_loop": (0, 8, {}),
    "hf_zero3_graphs": (8, 8, {}),  # the library's defaults
    "hf_zero3_graphs1": (1, 8, {}),
    "hf_zero3_graphs_unfused": (8, 8, {"HF_ZERO3_FUSE_QKV": _OFF}),
    "hf_zero3_graphs_torch_attention": (8, 8, {"HF_ZERO3_TRITON_ATTENTION": _OFF}),
    "hf_zero3_graphs_kernel_always": (8, 8, {"HF_ZERO3_TRITON_ATTENTION": "always"}),
    "hf_zero3_graphs_cublas_mlp": (8, 8, {"HF_ZERO3_TRITON_MLP": _OFF}),
    "hf_zero3_graphs_eager_prefill": (8, 8, {"HF_ZERO3_COMPILE_PREFILL": _OFF}),
    # a TRL rollout's defaults: the prompt forward and the decode step eager, the steps in CUDA graphs
    "hf_zero3_graphs_eager_step": (None, 8, _EAGER),
    # the same with the model's own RMSNorms (eight kernels each) instead of the norm kernel, and
    # with the model's own rotary embedding (ten kernels a layer) instead of the rotary kernel
    "hf_zero3_graphs_eager_step_own_norm": (None, 8, {**_EAGER, "HF_ZERO3_TRITON_NORM": _OFF}),
    # the same with the attention's PyTorch form (an eager step takes the Triton kernel at any batch)
    "hf_zero3_graphs_eager_step_torch_attention": (None, 8, {**_EAGER, "HF_ZERO3_TRITON_ATTENTION": _OFF}),
    # the same with graphs of 8 steps (an eager step's default is graphs of one): a call that
    # captures anew (a GRPO rollout after a training step, see BENCH_RECAPTURE) captures the 7- and
    # 8-step windows instead of one step
    "hf_zero3_graphs8_eager_step": (8, 8, _EAGER),
    "hf_zero3_graphs_eager_step_own_rotary": (None, 8, {**_EAGER, "HF_ZERO3_TRITON_ROTARY": _OFF}),
    # the compiled step as one compiled decoder layer that every layer runs (DecodeOptions.compile_layers)
    "hf_zero3_graphs_layer_step": (8, 8, {"HF_ZERO3_COMPILE_LAYERS": _ON}),
    "hf_zero3_graphs_no_split": (8, 8, {"HF_ZERO3_SPLIT_K": _OFF}),
    "hf_zero3_graphs_no_pdl": (8, 8, {"HF_ZERO3_PDL": _OFF}),
    "hf_zero3_graphs_cublas_qkv": (8, 8, {"HF_ZERO3_TRITON_QKV": _OFF}),
    "hf_zero3_graphs_fused_rope": (8, 8, {"HF_ZERO3_FUSE_ROPE": _ON}),
    "hf_zero3_graphs_no_rope": (8, 8, {"HF_ZERO3_FUSE_ROPE": _OFF}),
    "hf_zero3_graphs_rope_always": (8, 8, {"HF_ZERO3_FUSE_ROPE": _ON, "HF_ZERO3_TRITON_ATTENTION": "always"}),
    # a stop agreement every step: lockstep's and Zero3Safe's default
    "hf_zero3_graphs_sync1": (8, 1, {}),
}
SWITCHES = sorted({k for *_, env in OURS.values() for k in env})
# the slow per-layer baseline last, so that a run cut short still has the main comparison
ALL_CONFIGS = ("hf_eager_gathered", "hf_static_gathered", *OURS, "layerwise")
DEFAULT_CONFIGS = ("hf_eager_gathered", "hf_static_gathered", "hf_zero3_graphs")
_asked = os.environ.get("BENCH_CONFIGS", ",".join(DEFAULT_CONFIGS))
CONFIGS = ALL_CONFIGS if _asked == "all" else tuple(c for c in _asked.split(",") if c)
_unknown = sorted(set(CONFIGS) - set(ALL_CONFIGS))
if _unknown:
    raise SystemExit(f"BENCH_CONFIGS names unknown configurations {_unknown}; known: {', '.join(ALL_CONFIGS)}")


def rank_main(partial: str):
    import deepspeed
    import torch
    import torch.distributed as dist

    import hf_zero3
    from hf_zero3.testing import mark, models, strict_zero3_config

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = shape_config(SHAPE)
    ds = strict_zero3_config(world_size=dist.get_world_size(), bf16=True)
    if not OPTIMIZER:  # ZeRO-3 without an optimizer (DeepSpeed's ZeRO-Offload engine): the 8B shape on one 80 GB card
        del ds["optimizer"]
    model = models.zero3_model(cfg, ds, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(
        model=model, config=ds, **({"model_parameters": model.parameters()} if OPTIMIZER else {})
    )
    engine.eval()
    module = engine.module
    n_bytes = sum(p.ds_numel for p in module.parameters()) * 2

    def generate(name, kw):
        if name == "layerwise":
            return hf_zero3.lockstep_generate(engine, gather="layerwise", sync_every=4, **kw)
        if name in OURS:
            steps, every, _ = OURS[name]
            return hf_zero3.lockstep_generate(
                engine, gather="all", sync_every=every, decode="compiled", graph_steps=steps, **kw
            )
        # TRL's unwrap_model_for_generation: the whole model gathered and ZeRO-3's hooks off
        # (GatheredParameters + remove_hooks), then transformers' own generate()
        with hf_zero3.eval_forward(engine, gather="all"):
            extra = {"cache_implementation": "static"} if name == "hf_static_gathered" else {}
            return module.generate(**kw, synced_gpus=True, **extra)

    rows = []
    for batch, prompts in [(b, p) for b in BATCHES for p in PROMPTS]:
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), generator=g).to(dev)
        targets = torch.randint(MAX_NEW // 4, MAX_NEW + 1, (batch,), generator=g)
        prompt_kw = {}
        if prompts == "padded":
            lengths = torch.randint(PROMPT // 2, PROMPT + 1, (batch,), generator=g)
            mask = (torch.arange(PROMPT)[None, :] >= (PROMPT - lengths)[:, None]).long().to(dev)
            ids = ids.masked_fill(mask == 0, 0)
            prompt_kw = {"attention_mask": mask}
        targets[0] = MAX_NEW if rank == 0 else targets[0]
        useful = int(targets.sum())
        seen: dict = {}
        reference = None  # the first row's new tokens (HF eager's when it runs): what ``agree`` compares with
        for name in CONFIGS:
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name}#{seen[name]}"
            times, outs, captures = [], [], []
            hf_zero3.release_decode_graphs(module)  # each configuration builds its own loop
            set_switches(OURS[name][2] if name in OURS else {}, SWITCHES)
            # the seconds-long baselines (HF eager, per-layer) are timed once
            for rep in range(1 + (REPS if name.startswith("hf_zero3") or name == "hf_static_gathered" else 1)):
                mark(f"batch {batch} {prompts} {name} rep {rep}")
                if RECAPTURE and rep:
                    hf_zero3.release_decode_graphs(module)
                kw = dict(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
                kw.update(prompt_kw)
                dist.barrier()
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    outs.append(generate(name, kw))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                captures.append(getattr(getattr(module, "hf_zero3_last_generate", None), "graph_capture_s", None))
                if rep == 0:
                    first_capture = getattr(getattr(module, "hf_zero3_last_generate", None), "graph_capture_s", None)
            gen = outs[-1][:, -MAX_NEW:].cpu()
            reference = gen if reference is None else reference
            same = (gen == reference).int()
            agree = float(torch.where(same.all(1), MAX_NEW, (1 - same).argmax(1)).float().mean() / MAX_NEW)
            timed = sorted(times[1:])
            median = statistics.median(timed)
            tot = torch.tensor([useful, median, timed[0]], dtype=torch.float64, device=dev)
            dist.all_reduce(tot)
            stats = module.hf_zero3_last_generate if name.startswith("hf_zero3") or name == "layerwise" else None
            ours = stats if name.startswith("hf_zero3") else None  # the static loop's own fields
            report = getattr(ours, "decode_report", None)
            rows.append(
                dict(
                    batch=batch,
                    prompts=prompts,
                    config=label,
                    seconds=tot[1].item() / dist.get_world_size(),
                    seconds_min=tot[2].item() / dist.get_world_size(),
                    seconds_all=times[1:],
                    useful_tokens=int(tot[0].item()),
                    compile_s=max(0.0, times[0] - median),
                    first_call_s=times[0],
                    decode=getattr(ours, "decode", None),
                    loop=getattr(ours, "loop", None),
                    graph_steps=getattr(ours, "graph_steps", None),
                    capture_s=getattr(ours, "graph_capture_s", None),
                    capture_s_all=captures[1:] if ours is not None else None,
                    first_call_capture_s=first_capture,
                    graphs_reused=getattr(ours, "graphs_reused", None),
                    loop_reused=getattr(ours, "loop_reused", None),  # the median call's (the last timed one's)
                    graphs_moved=list(getattr(ours, "graphs_moved", ()) or ()),
                    attention=getattr(report, "attention", None),
                    fused_projections=getattr(report, "fused_projections", None),
                    mlp_kernels=getattr(report, "mlp_kernels", None),
                    split_k=getattr(report, "split_k", None),
                    prefill=getattr(ours, "prefill", None),
                    rope_attention=getattr(report, "rope_attention", None),
                    dependent_launches=getattr(report, "dependent_launches", None),
                    same_tokens_both_calls=all(torch.equal(outs[0], o) for o in outs[1:]),
                    agree=agree,
                    agree_with=CONFIGS[0],
                    forwards=getattr(stats, "forwards", None),
                    compiles=getattr(stats, "compiles", None),
                    weight_bytes=n_bytes,
                )
            )
            if rank == 0:  # as it is measured: a run cut short keeps its rows
                print("measured", rows[-1], flush=True)
                if os.environ.get("BENCH_COMPILE_TIMES"):  # where the first call's seconds went
                    from torch._dynamo.utils import compile_times

                    print(compile_times(repr="str", aggregate=True), flush=True)
                with open(partial, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    return rows


def main():
    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend()
    if backend != "nccl":
        print("bench_decode needs CUDA GPUs; skipped")
        return
    partial = os.path.join(scratch_dir(), "decode_partial.jsonl")  # rows as measured: a run cut short keeps them
    if os.path.exists(partial):
        os.remove(partial)
    rows = run_ranks(
        rank_main, world, args=(partial,), backend=backend, init="deepspeed", timeout=590, pg_timeout=120, capture=False
    )[0]
    import torch

    bw = hbm_tbps(torch.cuda.get_device_name(0)) * 1e12
    for r in rows:
        r["tokens_per_s"] = r["useful_tokens"] / r["seconds"] / world  # per rank, each row up to its length
        r["step_tokens_per_s"] = r["batch"] * MAX_NEW / r["seconds"]  # per rank, every row of every step
        r["floor_tok_s"] = r["batch"] / (r["weight_bytes"] / bw)
        r["fraction_of_floor"] = r["step_tokens_per_s"] / r["floor_tok_s"]
        r["useful_fraction_of_floor"] = r["tokens_per_s"] / r["floor_tok_s"]
    for batch, prompts in [(b, p) for b in BATCHES for p in PROMPTS]:
        base = {r["config"]: r for r in rows if r["batch"] == batch and r["prompts"] == prompts}
        if "hf_eager_gathered" not in base or "hf_static_gathered" not in base:
            continue
        for r in base.values():
            r["vs_hf_eager_gathered"] = r["tokens_per_s"] / base["hf_eager_gathered"]["tokens_per_s"]
            r["vs_hf_static"] = r["tokens_per_s"] / base["hf_static_gathered"]["tokens_per_s"]
    setup = dict(
        world=world,
        model="llama-3.2-1b-shape" if SHAPE == "llama-1b" else SHAPE + "-shape",
        dtype="bf16",
        max_new_tokens=MAX_NEW,
        prompt=PROMPT,
        prompts=",".join(PROMPTS),
        shape=SHAPE,
        batches=BATCHES,
        reps=REPS,
        recapture=RECAPTURE,
        hbm_tbps=bw / 1e12,
    )
    path = record("decode", rows, HERE, setup)
    print(setup)
    print(
        table(
            rows,
            [
                "batch",
                "prompts",
                "config",
                "seconds",
                "tokens_per_s",
                "step_tokens_per_s",
                "fraction_of_floor",
                "vs_hf_eager_gathered",
                "vs_hf_static",
                "compile_s",
                "graphs_reused",
                "forwards",
                "agree",
            ],
        )
    )
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
