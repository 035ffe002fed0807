"""Memory-plan settings, the budget, the DeepCompile schedule, and the accelerate / Trainer
injection, on CPU with real DeepSpeed ZeRO-3 engines over gloo (DeepCompile itself needs CUDA:
tests/gpu/test_memory_plan.py)."""

from __future__ import annotations

import pytest

from hf_zero3.compile.budget import compute_budget
from hf_zero3.compile.config import ConfigError, MemoryPlanConfig, parse_bytes
from hf_zero3.compile.gate import MemoryState
from hf_zero3.testing import DistributedFailure, run_ranks

GiB = 2**30


def test_sizes_parse_and_bad_sizes_name_the_format():
    assert parse_bytes("15GiB") == 15 * GiB and parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes(1024, minimum=1) == 1024 and parse_bytes("2e9") == 2 * 10**9
    assert parse_bytes("auto") is None and parse_bytes(None) is None
    with pytest.raises(ConfigError, match="not a size; write a size such as 15GiB"):
        parse_bytes("lots")
    with pytest.raises(ConfigError, match="must be positive"):
        parse_bytes(-1)


def test_config_values_over_environment_over_defaults_and_auto_means_default():
    env = {"HF_ZERO3_MODE": "match_zero3", "HF_ZERO3_MAX_MEMORY": "15GiB", "HF_ZERO3_GATE": "false"}
    c = MemoryPlanConfig.from_dict({"max_memory": "auto", "safety_margin": 0.05}, env=env)
    assert (c.mode, c.max_memory, c.gate, c.safety_margin) == ("match_zero3", 15 * GiB, False, 0.05)
    c = MemoryPlanConfig.from_dict({"mode": "budget"}, env=env)
    assert c.mode == "budget"
    assert MemoryPlanConfig.from_dict({"mode": "auto", "plan_step": "auto"}, env={}) == MemoryPlanConfig()
    assert MemoryPlanConfig.from_ds_config({"zero_optimization": {"stage": 3}}, env={}) == MemoryPlanConfig()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"mode": "fast"}, "mode='fast' is not one of"),
        ({"safety_margin": 0.9}, r"must be in \[0, 0.5\)"),
        ({"plan_step": -1}, "plan_step=-1 must be >= 0"),
        ({"gate": "maybe"}, "not a boolean"),
        ({"compile_backend": "aot_eager"}, "supports inductor or eager"),
        ({"max_memmory": "1GiB"}, r"unknown hf_zero3.memory_plan key\(s\) \['max_memmory'\]; known keys"),
    ],
)
def test_bad_settings_are_clear_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        MemoryPlanConfig.from_dict(values, env={})


def test_bad_sections_are_clear_errors():
    with pytest.raises(ConfigError, match="must be a mapping"):
        MemoryPlanConfig.from_ds_config({"hf_zero3": "on"}, env={})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['prefetch'\] under 'hf_zero3'"):
        MemoryPlanConfig.from_ds_config({"hf_zero3": {"prefetch": {}}}, env={})


def test_budget_counts_the_process_cap_not_the_card():
    total = 140 * GiB
    # 16 GiB per-process fraction on a 140 GiB card, 2 GiB of CUDA context + NCCL, 1 GiB cached free.
    state = MemoryState(allocated=5 * GiB, reserved=6 * GiB, free=total - 8 * GiB, total=total, fraction=16 / 140)
    b = compute_budget(MemoryPlanConfig(safety_margin=0.02), state, reserved=4 * GiB)
    assert b.non_pytorch == 2 * GiB and b.fragmentation == 1 * GiB
    assert b.limit == 16 * GiB  # the allocator's 16 GiB (non-PyTorch memory is outside the cap)
    assert b.budget == 16 * GiB - 1 * GiB - int(16 * GiB * 0.02) - 4 * GiB
    assert b.gate_budget == b.budget + 4 * GiB
    # uncapped: the card less what is used outside this allocator (context, NCCL, other processes)
    b = compute_budget(MemoryPlanConfig(safety_margin=0.0), MemoryState(0, 0, total - 2 * GiB, total), 0)
    assert b.limit == total - 2 * GiB and b.budget == total - 2 * GiB
    # a capped process on a card that other processes filled: what is really free binds
    crowded = MemoryState(allocated=5 * GiB, reserved=6 * GiB, free=4 * GiB, total=total, fraction=16 / 140)
    assert compute_budget(MemoryPlanConfig(safety_margin=0.0), crowded, 0).limit == 10 * GiB
    # a user max_memory below the cap wins
    b = compute_budget(MemoryPlanConfig(max_memory="10GiB", safety_margin=0.0), state, 0)
    assert b.limit == 10 * GiB


def _agree_budget_rank():
    import torch.distributed as dist

    from hf_zero3.compile.budget import agree_budget

    rank = dist.get_rank()
    state = MemoryState(allocated=(4 + rank) * GiB, reserved=(5 + 2 * rank) * GiB, free=100 * GiB, total=120 * GiB)
    local = compute_budget(MemoryPlanConfig(), state, reserved=GiB)
    return local, agree_budget(local)


def test_budget_is_agreed_as_the_tightest_rank():
    (l0, a0), (l1, a1) = run_ranks(_agree_budget_rank, 2, timeout=120, pg_timeout=30)
    assert l0.budget != l1.budget
    assert a0 == a1 and a0.budget == min(l0.budget, l1.budget)


def test_schedule_satisfies_deepspeed_pass_contracts():
    from deepspeed.compile import backend
    from deepspeed.compile.passes import zero3_compile
    from deepspeed.compile.passes.contract import PassContractError, validate_schedule

    from hf_zero3.compile.memory_plan import PASS_NAME, MemoryPlanPass, memory_plan_schedule, pass_contract

    backend.register_compile_pass(zero3_compile.NAME, zero3_compile.add_z3_gather_release, zero3_compile.CONTRACT)
    backend.register_compile_pass(PASS_NAME, MemoryPlanPass(MemoryPlanConfig()), pass_contract())
    assert memory_plan_schedule(MemoryPlanConfig()) == [(0, ["zero3_compile", PASS_NAME])]
    assert memory_plan_schedule(MemoryPlanConfig(plan_step=5)) == [
        (0, ["zero3_compile"]),
        (5, ["zero3_compile", PASS_NAME]),
    ]
    for cfg in (MemoryPlanConfig(), MemoryPlanConfig(plan_step=5)):
        validate_schedule(memory_plan_schedule(cfg), backend.opt_passes)
    with pytest.raises(PassContractError, match="requires \\['z3_gather_release'\\]"):
        validate_schedule([(0, [PASS_NAME])], backend.opt_passes)
    with pytest.raises(PassContractError, match="conflicts"):
        validate_schedule([(0, ["zero3_compile", PASS_NAME, "prefetch"])], backend.opt_passes)


SECTION = {"hf_zero3": {"memory_plan": {"mode": "auto", "max_memory": "auto", "plan_step": "auto"}}}


def _accelerate_rank(how: str, deepcompile: bool = False):
    """accelerate + DeepSpeed ZeRO-3 on CPU, the DeepSpeed config carrying our section with "auto"s."""
    import copy

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    from hf_zero3 import Zero3DeepSpeedPlugin, enable_memory_plan
    from hf_zero3.testing import models, strict_zero3_config

    ds = strict_zero3_config(world_size=2, micro_batch_size=2, extra=copy.deepcopy(SECTION))
    if deepcompile:
        ds["compile"] = {"deepcompile": True}
    if how == "plugin":
        plugin = Zero3DeepSpeedPlugin(hf_ds_config=ds, memory_plan={"gate": False})
    else:
        if how == "enabled":
            enable_memory_plan()
        plugin = DeepSpeedPlugin(hf_ds_config=ds)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    cfg = models.tiny_llama_config()
    cls = models.model_class_for(cfg)
    torch.manual_seed(0)
    model = cls._from_config(cfg)
    engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
    ids = torch.randint(3, 96, (2, 8))
    loss = engine(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    return dict(loss=float(loss), section=engine.config["hf_zero3"]["memory_plan"])


def test_accelerate_rejects_our_auto_values_without_hf_zero3():
    with pytest.raises(DistributedFailure, match="hf_zero3.memory_plan.mode` not found in kwargs"):
        run_ranks(_accelerate_rank, 2, args=("plain",), init="deepspeed", timeout=150, pg_timeout=60)


@pytest.mark.parametrize("how", ["plugin", "enabled"])
def test_accelerate_prepares_with_our_section_resolved(how):
    res = run_ranks(_accelerate_rank, 2, args=(how,), init="deepspeed", timeout=150, pg_timeout=60)
    for r in res:
        assert r["loss"] > 0
        sec = r["section"]
        assert sec["mode"] == "budget" and sec["max_memory"] is None and sec["plan_step"] == 0
        assert sec["gate"] is (how != "plugin")  # the plugin's memory_plan overrides the config


def test_deepcompile_on_cpu_is_a_clear_error():
    with pytest.raises(DistributedFailure, match="DeepCompile runs on CUDA only"):
        run_ranks(_accelerate_rank, 2, args=("plugin", True), init="deepspeed", timeout=150, pg_timeout=60)


def _trainer_rank(tmpdir: str):
    import copy

    from fixtures.trainer_job import make_trainer, train_losses

    from hf_zero3 import Zero3Safe
    from hf_zero3.accelerate import memory_plan_enabled

    trainer = make_trainer(tmpdir, callbacks=[Zero3Safe()], max_steps=2, ds_extra=copy.deepcopy(SECTION))
    trainer.train()
    return dict(
        losses=train_losses(trainer),
        enabled=memory_plan_enabled(),
        section=trainer.model_wrapped.config["hf_zero3"]["memory_plan"],
    )


def test_trainer_with_zero3safe_accepts_the_section(tmp_path):
    for r in run_ranks(_trainer_rank, 2, args=(str(tmp_path),), init="deepspeed", timeout=200, pg_timeout=60):
        assert r["enabled"] and len(r["losses"]) == 2
        assert r["section"]["mode"] == "budget"


def _pending_rank():
    import deepspeed
    import torch

    from hf_zero3._upstream.deepspeed import pending_optimizer_bytes
    from hf_zero3.testing import models, strict_zero3_config

    ds = strict_zero3_config(world_size=2)
    model = models.zero3_model(models.tiny_llama_config(), ds)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    shard = sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat)
    before = pending_optimizer_bytes(engine)
    ids = torch.randint(3, 96, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return shard, before, pending_optimizer_bytes(engine)


def test_step0_plan_reserves_adams_states_until_they_exist():
    for shard, before, after in run_ranks(_pending_rank, 2, init="deepspeed", timeout=150, pg_timeout=60):
        assert shard > 0
        assert before == shard * 4 * 2  # exp_avg + exp_avg_sq, fp32, this rank's shard
        assert after == 0


def test_budget_fits_the_capped_1b_run_that_failed_on_units():
    """A capped 1B job on two GPUs that plain ZeRO-3 trains: 16 GiB cap, 2.52 GiB
    non-PyTorch, 1.06 GiB fragmentation, 4.60 GiB of Adam states still to come, and a backward
    graph whose profile (then allocated + non-PyTorch) peaked at 11.65 GiB. Budgeting the
    allocator against that profile refused a job plain ZeRO-3 trains; with the profile in the
    allocator's units too (9.13 GiB: the 2.52 GiB no longer added) it fits."""
    from hf_zero3.compile.planner import GraphProfile, NodeProfile, check_floor

    total = int(139.8 * GiB)
    nonpt, frag, allocated = int(2.52 * GiB), int(1.06 * GiB), int(9.0 * GiB)
    state = MemoryState(
        allocated=allocated,
        reserved=allocated + frag,
        free=total - allocated - frag - nonpt,
        total=total,
        fraction=16 * GiB / total,
    )
    b = compute_budget(MemoryPlanConfig(), state, reserved=int(4.60 * GiB))
    assert b.budget > int((11.65 - 2.52) * GiB)  # room left for prefetches
    assert b.gate_budget < 16 * GiB  # at run time, still under the allocator's cap
    bwd = GraphProfile(
        1, (NodeProfile("x", "input"), NodeProfile("mm", alloc=int((7.9 - 2.52) * GiB), peak=int((11.65 - 2.52) * GiB)))
    )
    check_floor(bwd, b.limit - b.safety, b.reserved)  # 5.4 + 4.6 GiB resident fits under the limit


@pytest.mark.parametrize(
    "values, env, message",
    [
        ({"max_memory": "0.5"}, {}, r"hf_zero3.memory_plan.max_memory='0.5' is 0.5 bytes, not a whole number"),
        ({"max_memory": "1e400"}, {}, r"max_memory='1e400' is not a finite size"),
        ({"max_memory": float("nan")}, {}, r"max_memory=nan is not a finite size"),
        ({"max_memory": "1.2.3GiB"}, {}, r"max_memory='1.2.3GiB' is not a size; write a size such as 15GiB"),
        ({"max_memory": 512}, {}, r"only 512 bytes, below the 1048576-byte minimum"),
        ({"plan_step": 1.7}, {}, r"hf_zero3.memory_plan.plan_step=1.7 is not a whole number of steps"),
        ({"safety_margin": "nan"}, {}, r"safety_margin='nan' must be in \[0, 0.5\)"),
        ({}, {"HF_ZERO3_MODE": "bogus"}, r"HF_ZERO3_MODE='bogus' is not one of"),
        (
            {},
            {"HF_ZERO3_MAXMEMORY": "1GiB"},
            r"HF_ZERO3_MAXMEMORY is not an hf_zero3 setting; did you mean "
            r"HF_ZERO3_MAX_MEMORY\?",
        ),
    ],
)
def test_edge_values_are_named_with_their_key_or_variable(values, env, message):
    """Issue #11, finding 6: every bad value names its key (or environment variable) and the forms."""
    with pytest.raises(ConfigError, match=message):
        MemoryPlanConfig.from_dict(values, env=env)


def test_a_section_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match=r"hf_zero3.memory_plan must be a mapping of settings, got list"):
        MemoryPlanConfig.from_ds_config({"hf_zero3": {"memory_plan": []}}, env={})
    assert MemoryPlanConfig.from_dict({"plan_step": "2"}, env={}).plan_step == 2  # whole numbers as text are fine


def _documented_variables() -> list[str]:
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "environment.md"
    return re.findall(r"^\| `(HF_ZERO3_[A-Z0-9_]+)` \|", page.read_text(), flags=re.M)


#: A value a user would set for each documented variable; the memory plan's own take "auto".
_SAMPLE_VALUES = {
    "HF_ZERO3_AGREE_TIMEOUT": "30",
    "HF_ZERO3_PLAN_DUMP": "plan_dump",
    "HF_ZERO3_NATIVE": "0",
    "HF_ZERO3_BUILD_EXT": "1",
    "HF_ZERO3_TRITON_ATTENTION": "always",
}


def _every_documented_variable_rank(names):
    import os

    from hf_zero3 import MemoryPlanConfig, Zero3DeepSpeedPlugin
    from hf_zero3.compile.config import ConfigError
    from hf_zero3.testing import strict_zero3_config

    ds = strict_zero3_config(world_size=1, extra={"compile": {"deepcompile": True}})
    refused = {}
    for name in names:
        os.environ[name] = _SAMPLE_VALUES.get(
            name, "auto" if name.lower()[9:] in MemoryPlanConfig.__dataclass_fields__ else "0"
        )
        try:
            MemoryPlanConfig.from_ds_config(ds)
            Zero3DeepSpeedPlugin(hf_ds_config=ds)
        except ConfigError as exc:
            refused[name] = str(exc)
        finally:
            del os.environ[name]
    os.environ["HF_ZERO3_PDLL"] = "0"  # and a typo is still caught
    try:
        MemoryPlanConfig.from_ds_config(ds)
    except ConfigError as exc:
        typo = str(exc)
    else:
        typo = None
    return refused, typo


def test_every_documented_variable_builds_the_plugin_and_the_memory_plan_config():
    """Setting any documented HF_ZERO3_* variable (a decode switch such as HF_ZERO3_PDL=0 included)
    leaves the memory plan's settings and the accelerate plugin buildable; a misspelt one is still
    refused by name. The registry, the documentation's table and the code name the same variables."""
    from hf_zero3.options import ENVIRONMENT

    names = _documented_variables()
    assert set(ENVIRONMENT) <= set(names), set(ENVIRONMENT) - set(names)
    (result,) = run_ranks(
        _every_documented_variable_rank, 1, args=(names,), init="deepspeed", timeout=120, pg_timeout=30
    )
    refused, typo = result
    assert refused == {}, refused
    assert typo is not None and "HF_ZERO3_PDLL" in typo and "did you mean HF_ZERO3_PDL?" in typo, typo
