"""Rank-side code for the memory-plan GPU tests (NCCL, one GPU a rank): the 4-layer Llama of
_deepcompile_workers, bf16, ZeRO-3 default settings, DeepCompile."""

from __future__ import annotations

import torch
from _deepcompile_workers import batch, build, dc_config


def _engine(setting: str, plan_kwargs: dict | None = None):
    engine = build(compile_=False, torch_adam=True)
    planner = None
    if setting == "zero3_only":
        engine.compile(schedule=[(0, ["zero3_compile"])])
    else:
        from hf_zero3.compile import MemoryPlanConfig
        from hf_zero3.compile.memory_plan import compile_with_memory_plan

        planner = compile_with_memory_plan(engine, MemoryPlanConfig(**(plan_kwargs or {})))
    return engine, planner


def _step(engine, s):
    import torch.distributed as dist

    ids = batch(s, dist.get_rank(), engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def train(
    setting: str,
    steps: int = 6,
    plan_kwargs: dict | None = None,
    squeeze_after: int | None = None,
    squeeze_rank: int = 0,
    squeeze_gib: float = 0.0,
):
    """Train ``steps`` steps; from step ``squeeze_after`` on, rank ``squeeze_rank`` alone holds an
    extra ``squeeze_gib`` GiB, so its headroom differs from its peers'."""
    import torch.distributed as dist

    from hf_zero3.compile.gate import counters, reset_counters
    from hf_zero3.testing import mark

    reset_counters()
    engine, planner = _engine(setting, plan_kwargs)
    losses, snapshots, ballast = [], [], None
    for s in range(steps):
        if squeeze_after is not None and s == squeeze_after and dist.get_rank() == squeeze_rank:
            ballast = torch.empty(int(squeeze_gib * 2**30), dtype=torch.uint8, device="cuda")
        mark(f"{setting} step {s}")
        losses.append(_step(engine, s))
        snapshots.append(counters())
    del ballast
    from hf_zero3.compile import gate

    return dict(
        losses=losses,
        counters=snapshots,
        plan=planner.summary() if planner else None,
        rank=dist.get_rank(),
        agree_backends=sorted({dist.get_backend(g) for g in gate._GROUPS.values()}),
    )


def accelerate_plugin(steps: int = 3):
    """accelerate as under the DeepSpeed launcher: no dynamo backend, our plugin, "auto" values."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim

    import hf_zero3
    from hf_zero3 import Zero3DeepSpeedPlugin
    from hf_zero3.testing import models

    ds = dc_config(dist.get_world_size())
    ds["optimizer"]["params"]["torch_adam"] = True
    ds["hf_zero3"] = {"memory_plan": {"mode": "auto", "max_memory": "auto", "gate": True}}
    plugin = Zero3DeepSpeedPlugin(hf_ds_config=ds)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    cfg = models.small_llama_config()
    cls = models.model_class_for(cfg)
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=torch.bfloat16)
    engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
    losses = []
    for s in range(steps):
        ids = batch(s, dist.get_rank(), accelerator.device)
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)  # accelerate's DeepSpeed wrapper also steps the engine
        losses.append(float(loss.item()))
    planner = hf_zero3.runtime_of(engine).memory.plan
    return dict(compiled=bool(engine.is_compiled), losses=losses, plan=planner.summary() if planner else None)


# --- issue #13's user configuration -------------------------------------------------------------

#: Per-process cap by world size: 16 GiB for 2 ranks, just above plain ZeRO-3's reserved peak
#: there. One rank holds the whole partition, so its cap sits just above plain ZeRO-3's uncapped
#: reserved peak, which OOMs in its optimizer step below it (see the memory plan's table in
#: benchmarks/RESULTS.md and HISTORY.md).
USER_CAP_GIB = {1: 30.0, 2: 16.0}


def train_user_config(setting: str, steps: int = 12, cap_gib: float | None = None):
    """What a user writes: ``LlamaForCausalLM(config)`` handed to ``deepspeed.initialize`` (no
    zero.Init), ``gradient_checkpointing_enable()`` with transformers' defaults, DeepSpeed's default
    AdamW (fused), ZeRO-3 defaults, bf16, batch 1 x 512, the process capped with
    ``set_per_process_memory_fraction``; then plain ZeRO-3, DeepCompile's zero3 pass only, or
    ``compile_with_memory_plan`` with the default config. Peak stats are never reset here."""
    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import hf_zero3
    from hf_zero3.testing import llama_1b_shape_config, mark

    world, rank = dist.get_world_size(), dist.get_rank()
    cap = USER_CAP_GIB[world] if cap_gib is None else cap_gib
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if setting != "plain":
        ds["compile"] = {"deepcompile": True}
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_1b_shape_config())
    model.gradient_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    planner = None
    if setting == "zero3_only":
        engine.compile(schedule=[(0, ["zero3_compile"])])
    elif setting == "default":
        planner = hf_zero3.compile_with_memory_plan(engine)
    losses = []
    for s in range(steps):
        mark(f"{setting} step {s}")
        g = torch.Generator().manual_seed(100 * s + rank)
        ids = torch.randint(3, 128256, (1, 512), generator=g).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return dict(
        losses=losses,
        cap_gib=cap,
        peak_alloc=torch.cuda.max_memory_allocated(),
        plan=planner.summary() if planner else None,
        calibration=[list(h) for h in planner.calibration.history] if planner else None,
    )
