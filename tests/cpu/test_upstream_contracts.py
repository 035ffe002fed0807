"""Contract tests: one per accessor of ``hf_zero3._upstream`` (every private read of DeepSpeed,
transformers, accelerate, TRL and torch), each on real objects of the installed release. A library
upgrade that moves an attribute fails here, by name. Versions checked: each module's ``CHECKED``, which
covers every release set CI runs (``_upstream.versions.RELEASE_SETS``);
DeepCompile's accessors need CUDA and are exercised by the GPU tests (tests/gpu)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from hf_zero3._upstream import accelerate as acc_up
from hf_zero3._upstream import deepspeed as ds_up
from hf_zero3._upstream import torch as torch_up
from hf_zero3._upstream import transformers as hf_up
from hf_zero3._upstream import transformers_trainer as trainer_up
from hf_zero3._upstream import trl as trl_up
from hf_zero3.testing import run_ranks


def test_checked_versions_are_the_tested_ones():
    """Every release CI runs (each release set of ``_upstream.versions``) is one each module's
    accessors were checked against."""
    from hf_zero3._upstream.versions import RELEASE_SETS

    for name, releases in RELEASE_SETS.items():
        assert releases["deepspeed"] in ds_up.CHECKED, name
        assert releases["transformers"] in hf_up.CHECKED, name
        assert releases["accelerate"] in acc_up.CHECKED, name
        assert releases["trl"] in trl_up.CHECKED, name


def test_transformers_generation_contract_holds():
    """Everything the fast decode path reads of transformers' generation is there: the KV cache's
    keyword (``cache`` from 5.25, ``past_key_values`` before) in generate()'s model inputs, model
    forwards and its output class, the static cache classes, the overridden private methods."""
    hf_up.recheck_generation()
    assert hf_up.contract_problems() == ()
    key = hf_up.cache_keyword()
    assert key in hf_up.CACHE_KEYWORDS
    from transformers import StaticCache

    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config()).eval()
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **hf_up.cache_arguments(cache))
    assert out[key] is cache and cache.layers[0].is_initialized  # the forward filled the cache passed by that name
    kwargs = {key: cache}
    assert hf_up.generation_cache(kwargs) is cache and hf_up.passed_cache({key: cache}) is cache
    assert hf_up.decoder_only_output(torch.zeros(1, 2), cache)[key] is cache


def _rename_cache_keyword():
    """Simulate a transformers release that takes the KV cache as ``kv_cache``: generate() still
    works (the old keyword passes through), every read of hf_zero3's fast path would miss it."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.prepare_inputs_for_generation

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, kv_cache=None, **kwargs):
        return original(self, input_ids, next_sequence_length, **kwargs)

    return GenerationMixin, "prepare_inputs_for_generation", prepare_inputs_for_generation


def _generate_after_a_rename():
    from _zero3_workers import build_engine

    import hf_zero3

    engine, ref = build_engine(hf_aware=False)
    owner, name, renamed = _rename_cache_keyword()
    setattr(owner, name, renamed)
    hf_up.recheck_generation()
    ids = torch.tensor([[3, 4, 5, 6]])
    gen = dict(max_new_tokens=6, pad_token_id=0, do_sample=False)
    with torch.no_grad():
        out = hf_zero3.lockstep_generate(engine, input_ids=ids, gather="all", decode="compiled", **gen)
        exp = ref.generate(input_ids=ids, **gen)
    stats = engine.module.hf_zero3_last_generate
    return out.tolist(), exp.tolist(), stats.decode, stats.decode_reason


def test_a_renamed_cache_keyword_falls_back_with_the_reason():
    """decode="compiled" on a release that renamed the cache's keyword: transformers' eager loop,
    the right tokens, and the reason naming the read, not a silent fallback."""
    out, exp, decode, reason = run_ranks(_generate_after_a_rename, 1, init="deepspeed", timeout=120, pg_timeout=30)[0]
    assert out == exp
    assert decode == "eager" and "the KV cache's keyword" in reason and "transformers" in reason, reason


def test_a_renamed_cache_keyword_fails_the_contract_by_name(monkeypatch):
    """A release that renames the cache's keyword again fails the contract test, naming the read."""
    monkeypatch.setattr(*_rename_cache_keyword())
    hf_up.recheck_generation()
    try:
        assert hf_up.cache_keyword() is None
        assert hf_up.generation_cache({"past_key_values": 1, "cache": 2}) is None
        with pytest.raises(AssertionError, match="the KV cache's keyword"):
            test_transformers_generation_contract_holds()
    finally:
        monkeypatch.undo()
        hf_up.recheck_generation()
    assert hf_up.contract_problems() == ()


def _deepspeed_engine_contracts():
    import deepspeed

    from hf_zero3.testing import models, strict_zero3_config

    ds = strict_zero3_config(world_size=1)
    model = models.plain_model(models.tiny_llama_config())  # built plainly, handed to initialize
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    p = next(engine.module.parameters())
    out = {}
    out["param"] = (
        ds_up.is_zero3_param(p),
        ds_up.param_full_numel(p) == p.ds_numel > 0,
        ds_up.param_shard(p) is p.ds_tensor,
        isinstance(ds_up.param_id(p), int),
        ds_up.param_group(p) is not None,
    )
    params = list(engine.module.parameters())
    before = ds_up.param_available(p)
    ds_up.gather_now(params)
    gathered = all(ds_up.param_available(q) and q.numel() == q.ds_numel for q in params)
    ds_up.partition_now(params)
    with ds_up.gathered_parameters(params):
        inside = ds_up.param_available(p)
    out["gather"] = (before, gathered, ds_up.param_available(p), inside)
    offload = ds_up.engine_offload(engine)
    ids = ds_up.offload_hook_ids(offload)
    tables = {k for m in ds_up.offload_module(offload).modules() for _, t in ds_up.module_hook_dicts(m) for k in t}
    out["engine"] = (
        ds_up.is_engine(engine),
        ds_up.engine_module(engine) is engine.module,
        ds_up.engine_global_steps(engine),
        ds_up.engine_zero_stage(engine),
        ds_up.deepcompile_enabled(engine),
        ds_up.deepcompile_active(engine),
        ds_up.engine_is_compiled(engine),
    )
    out["offload"] = (
        offload is not None,
        ds_up.offload_from_module_hooks(engine.module) is offload,
        ds_up.offload_module(offload) is engine.module,
        bool(ids) and ids <= tables,
    )
    out["pending"] = ds_up.pending_optimizer_bytes(engine) > 0
    module = engine.module
    found = ds_up.engine_forward_hooks(module)
    order = [list(t) for _, t in ds_up.module_hook_dicts(module)]
    with ds_up.engine_forward_hooks_suspended(module):
        inside = [set(t) for _, t in ds_up.module_hook_dicts(module)]
    out["engine_hooks"] = (
        len(found),
        {k for _, k in found} == {engine.module_forward_pre_hook.id, engine.module_forward_post_hook.id},
        all(k not in t for (_, k) in found for t in inside),
        [list(t) for _, t in ds_up.module_hook_dicts(module)] == order,
    )
    out["boundary"] = (
        hasattr(engine, "is_gradient_accumulation_boundary"),
        ds_up.accumulation_boundary(engine),
        ds_up.accumulation_boundary(object()),
    )
    out["deepcompile_supported"] = ds_up.deepcompile_supported()
    out["launch_early"] = ds_up.launch_pending_compile_passes(engine)  # no DeepCompile: nothing to launch

    from deepspeed.runtime.rollout import HybridEngineRollout

    tok = type("Tok", (), {"eos_token_id": 2, "pad_token_id": 0})()
    rollout = HybridEngineRollout(engine, tok)
    out["rollout"] = (
        ds_up.hybrid_rollout_module(rollout) is engine.module,
        ds_up.hybrid_rollout_tokenizer(rollout) is tok,
    )
    return out


@pytest.fixture(scope="module")
def engine_contracts():
    return run_ranks(_deepspeed_engine_contracts, 1, init="deepspeed", timeout=120, pg_timeout=30)[0]


def test_zero3_parameter_attributes(engine_contracts):
    assert engine_contracts["param"] == (True, True, True, True, True)
    # partitioned, gathered by hand, partitioned again, gathered inside GatheredParameters
    assert engine_contracts["gather"] == (False, True, False, True)


def test_engine_accessors(engine_contracts):
    assert engine_contracts["engine"] == (True, True, 0, 3, False, False, False)
    assert engine_contracts["pending"]
    assert engine_contracts["boundary"] == (True, True, True)  # accumulation 1: every step is a boundary
    assert engine_contracts["launch_early"] is False


def test_the_engines_forward_prologue_hooks_are_found_and_put_back_in_order(engine_contracts):
    # DeepSpeed 0.19.8 runs its forward prologue/epilogue as two hooks on the module itself
    assert engine_contracts["engine_hooks"] == (2, True, True, True)


def test_eager_hook_owner_found_from_engine_and_from_the_bare_module(engine_contracts):
    assert engine_contracts["offload"] == (True, True, True, True)


def test_deepcompile_is_refused_on_cpu_with_the_reason(engine_contracts):
    ok, why = engine_contracts["deepcompile_supported"]
    assert not ok and "DeepCompile runs on CUDA only" in why


def test_hybrid_engine_rollout_attributes(engine_contracts):
    assert engine_contracts["rollout"] == (True, True)


def test_zero3_linear_runs_its_forward_without_the_autograd_function_under_no_grad(monkeypatch):
    """DeepSpeed's own process-wide replacement of F.linear (what zero.Init leaves behind): inside
    the context, under no_grad, the same results bit for bit without the Function; with grad
    enabled, the Function; afterwards, DeepSpeed's wrapper again."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    monkeypatch.setattr(F, "linear", zero3_linear_wrap)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    inputs = [
        (torch.randn(3, 4, generator=g), b),
        (torch.randn(2, 3, 4, generator=g), b),
        (torch.randn(2, 3, 4, generator=g), None),
    ]
    with torch.no_grad():
        before = [zero3_linear_wrap(x, w, bias) for x, bias in inputs]
        with ds_up.zero3_linear_without_autograd():
            assert F.linear is not zero3_linear_wrap
            after = [torch.nn.functional.linear(x, w, bias) for x, bias in inputs]
    for x, y in zip(before, after):
        assert torch.equal(x, y)
    with ds_up.zero3_linear_without_autograd():
        out = F.linear(inputs[0][0], w.requires_grad_(), b)
        assert "LinearFunctionForZeroStage3" in type(out.grad_fn).__name__
    assert F.linear is zero3_linear_wrap
    monkeypatch.undo()
    with ds_up.zero3_linear_without_autograd():  # not DeepSpeed's: left alone
        assert F.linear is torch.nn.functional.linear and "zero3" not in F.linear.__name__


def test_deepcompile_pass_table_and_param_manager():
    from deepspeed.compile import backend
    from deepspeed.compile.graph_param import DSGraphParamManager
    from torch.fx import Graph

    fn = lambda *a: None  # noqa: E731
    ds_up.register_compile_pass("hf_zero3_contract_probe", fn, ds_up.gather_release_contract(frozenset()))
    assert backend.opt_passes["hf_zero3_contract_probe"] is fn
    graph = Graph()
    x = graph.placeholder("w")
    graph.output(x)
    manager = DSGraphParamManager(graph, [torch.zeros(2, 2)], [(0, 7, (2, 2))])
    assert ds_up.graph_param_ids({3: manager}, 3) == {7} and ds_up.graph_param_ids({}, 3) == set()
    assert set(ds_up.profile_meta_defaults())


def test_deepcompile_launch_pops_the_steps_passes_and_resets_dynamo():
    """What launching a step's passes before a rollout relies on (``launch_pending_compile_passes``):
    the schedule's head is the next step to launch, a launch pops it (so the training forward's own
    launch at that step finds nothing), and the launch is where Dynamo is reset."""
    import inspect

    from deepspeed.compile import backend

    src = inspect.getsource(backend.launch_compile_passes)
    assert "remaining_schedule.popleft()" in src and "torch._dynamo.reset()" in src
    saved = backend.remaining_schedule  # None until an engine compiles
    fn = lambda *a: None  # noqa: E731
    try:
        backend.init_schedule([(0, [fn]), (5, [fn])])
        assert ds_up.passes_pending_at(0) and not ds_up.passes_pending_at(1) and not ds_up.passes_pending_at(5)
        backend.remaining_schedule.popleft()  # what the launch at step 0 does
        assert ds_up.passes_pending_at(5) and not ds_up.passes_pending_at(0)
        backend.init_schedule([])
        assert not ds_up.passes_pending_at(0)
    finally:
        backend.remaining_schedule = saved


def test_deepcompile_profiling_result_fields():
    from deepspeed.compile.profilers import ProfilingResult

    prof = ProfilingResult()
    for bwd in (False, True):
        graph, mem, times, sizes = ds_up.profile_fields(prof, bwd)
        assert graph is None and all(x is not None or x is None for x in (mem, times, sizes))
    assert ds_up.profile_all_peaks(prof) == []
    assert ds_up.profile_complete(prof, False) is False


def test_deepcompile_profile_reads_memory_outside_torch_through_one_module_global():
    """The profilers read ``_get_mem_usage_out_of_torch`` by name (patched to 0 with the plan)."""
    import inspect

    from deepspeed.compile.profilers import graph_profile

    from hf_zero3._upstream import patches

    src = inspect.getsource(graph_profile)
    assert src.count("self.mem_usage_out_of_torch = _get_mem_usage_out_of_torch()") >= 2  # both profilers
    original = graph_profile._get_mem_usage_out_of_torch
    with patches.scope():
        patches.install("deepcompile_profile_in_allocator_units", ds_up.patch_deepcompile_profile_in_allocator_units)
        assert graph_profile._get_mem_usage_out_of_torch() == 0
        got = graph_profile._absolute_profile_memory(graph_profile._get_mem_usage_out_of_torch())
        acc = graph_profile.get_accelerator()
        # the allocator's own readings, nothing added (on CPU they are the process's, which moves by
        # a page or so between two reads)
        for value, now in zip(got, (acc.memory_allocated(), acc.max_memory_allocated())):
            assert abs(value - now) <= 1 << 20, (got, now)
    assert graph_profile._get_mem_usage_out_of_torch is original


def test_transformers_generation_hooks_and_length_argument():
    from transformers.generation.utils import GenerationMixin

    hf_up.generation_hooks_present()
    params = list(inspect.signature(GenerationMixin._prepare_generated_length).parameters)
    # self, generation_config, then input_ids_length 4th among the rest: input_length_arg's args[3]
    assert params[:2] == ["self", "generation_config"] and params.index("input_ids_length") == 2 + 3
    assert hf_up.input_length_arg((None, None, None, 9), {}) == 9
    assert hf_up.input_length_arg((), {"input_ids_length": 5}) == 5
    # compiled decode: the hook lockstep overrides (model_kwargs, generation_config) and the field it sets
    params = list(inspect.signature(getattr(GenerationMixin, hf_up.COMPILE_HOOK)).parameters)
    assert params == ["self", "model_kwargs", "generation_config"]
    # the static decode loop: the loop it takes over, its arguments, the internals it reads
    assert tuple(inspect.signature(getattr(GenerationMixin, hf_up.SAMPLE_HOOK)).parameters) == hf_up.SAMPLE_PARAMS
    from transformers.cache_utils import StaticLayer
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    assert {"max_length"} <= set(inspect.signature(MaxLengthCriteria).parameters)
    assert hasattr(EosTokenCriteria(eos_token_id=2), "eos_token_id")
    assert "max_cache_len" in inspect.signature(StaticLayer).parameters
    assert hf_up.generation_config_field("max_cache_len") and not hf_up.generation_config_field("no_such_field")


def test_transformers_attention_registries_take_a_named_decode_attention():
    import torch
    from transformers.cache_utils import StaticLayer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def probe(*args, **kwargs):
        return None, None

    hf_up.register_attention("hf_zero3_contract_probe", probe)
    assert ALL_ATTENTION_FUNCTIONS["hf_zero3_contract_probe"] is probe
    assert ALL_MASK_ATTENTION_FUNCTIONS["hf_zero3_contract_probe"] is sdpa_mask
    assert callable(hf_up.sdpa_attention())
    # the length counter the static loop hands back to a new cache: a one-element tensor per layer
    layer = StaticLayer(max_cache_len=8)
    assert isinstance(layer.cumulative_length, torch.Tensor) and layer.cumulative_length.numel() == 1
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    assert int(layer.cumulative_length) == 3 and layer.keys.shape == (1, 2, 8, 4)


def test_dynamo_graph_counter_counts_a_compile():
    import torch

    from hf_zero3._upstream.torch import dynamo_graph_count

    before = dynamo_graph_count()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert dynamo_graph_count() == before + 1


def test_inductor_backend_calls_the_compile_fx_of_the_module_the_launcher_wraps(monkeypatch):
    """run_ranks serializes a group's CPU compiles by replacing this module's ``compile_fx``:
    torch.compile's inductor backend must look it up there at each compile."""
    module = torch_up.inductor_compile_module()
    seen = []

    def stop(gm, *args, **kwargs):
        seen.append(gm)
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(module, "compile_fx", stop)
    with pytest.raises(Exception, match="stopped before compiling"):
        torch.compile(lambda x: x * 3 - 1, backend="inductor")(torch.ones(3))
    assert len(seen) == 1


def test_cpu_vec_isa_probe_runs():
    """The fork server of run_ranks probes the CPU's vector ISA once for every rank it forks."""
    torch_up.probe_cpu_vec_isa()


def test_profiler_running_is_true_inside_a_torch_profiler_only():
    """The static loop opens its profiler ranges only while this says a profiler records."""
    assert torch_up.profiler_running() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert torch_up.profiler_running() is True
    assert torch_up.profiler_running() is False


def _trainer_contracts(tmpdir):
    from fixtures.trainer_job import make_trainer
    from transformers import TrainerCallback

    found = {}

    class Probe(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):
            found["trainer"] = trainer_up.trainer_calling_callback()

    trainer = make_trainer(tmpdir, callbacks=[Probe()], max_steps=1)
    config = trainer_up.trainer_deepspeed_config(trainer)
    before = trainer_up.trainer_engine(trainer)
    trainer.train()
    return dict(
        found=found["trainer"] is trainer,
        stage=config["zero_optimization"]["stage"],
        engine_before=before is not None,
        engine_after=trainer_up.trainer_engine(trainer) is trainer.model_wrapped,
        outside=trainer_up.trainer_calling_callback() is None,
    )


def test_trainer_found_from_its_callback_and_its_engine_after_prepare(tmp_path):
    r = run_ranks(_trainer_contracts, 1, args=(str(tmp_path),), init="deepspeed", timeout=120, pg_timeout=30)[0]
    assert r == dict(found=True, stage=3, engine_before=False, engine_after=True, outside=True)


def test_hf_deepspeed_config_reference_round_trips():
    saved = hf_up.hf_deepspeed_config_ref()
    hf_up.set_hf_deepspeed_config_ref(None)
    assert hf_up.hf_deepspeed_config_ref() is None
    hf_up.set_hf_deepspeed_config_ref(saved)
    assert hf_up.hf_deepspeed_config_ref() is saved


def test_accelerate_and_deepspeed_patches_apply_and_undo():
    from accelerate import Accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    compile_, prepare = DeepSpeedEngine.compile, Accelerator._prepare_deepspeed
    undo = acc_up.patch_deepspeed_compile_default_schedule(lambda engine: None)
    assert DeepSpeedEngine.compile is not compile_ and "schedule" in inspect.signature(compile_).parameters
    undo()
    undo = acc_up.patch_accelerate_prepare_deepspeed(lambda a: None, lambda a, e, s: None)
    assert Accelerator._prepare_deepspeed is not prepare
    undo()
    assert (DeepSpeedEngine.compile, Accelerator._prepare_deepspeed) == (compile_, prepare)


def _torch_contracts():
    import torch.distributed as dist

    store = torch_up.default_store()
    store.set("hf_zero3/contract", "1")
    module = torch.nn.Linear(2, 2)
    before = torch_up.compiled_call(module)
    module.compile(backend="eager")
    compiled = torch_up.compiled_call(module) is not None
    torch_up.set_compiled_call(module, None)
    return dict(
        store=store.check(["hf_zero3/contract"]) and store.get("hf_zero3/contract") == b"1",
        timeout=torch_up.group_timeout(dist.group.WORLD).total_seconds(),
        before=before,
        compiled=compiled,
        reset=torch_up.compiled_call(module) is None,
    )


def test_torch_store_group_timeout_and_compiled_call():
    r = run_ranks(_torch_contracts, 1, timeout=120, pg_timeout=17)[0]
    assert r == dict(store=True, timeout=17.0, before=None, compiled=True, reset=True)
    assert torch_up.cuda_memory_fraction(torch.device("cpu")) == 1.0 or torch.cuda.is_available()


def test_module_has_matches_hasattr():
    """``module_has`` answers as ``hasattr`` for an instance attribute, a parameter, a buffer, a
    submodule, a class attribute and a missing name (it reads torch's per-module tables)."""

    class M(torch.nn.Module):
        kind = "cls"

        def __init__(self):
            super().__init__()
            self.flag = 1
            self.sinks = torch.nn.Parameter(torch.zeros(2))
            self.register_buffer("buf", torch.zeros(1))
            self.child = torch.nn.Linear(2, 2)

    m = M()
    for name in ("flag", "sinks", "buf", "child", "kind", "forward", "missing"):
        assert torch_up.module_has(m, name) == hasattr(m, name), name
    assert not torch_up.module_has(torch.nn.Linear(2, 2), "sinks")


def test_runs_class_forward_sees_instance_forwards_and_hooks():
    """``runs_class_forward`` is False once a forward is set on the instance or a forward or
    forward-pre hook is registered, and True again after they are gone (torch's hook tables)."""
    m = torch.nn.Linear(2, 2)
    assert torch_up.runs_class_forward(m)
    m.forward = lambda x: x
    assert not torch_up.runs_class_forward(m)
    del m.forward
    for register in (m.register_forward_hook, m.register_forward_pre_hook):
        handle = register(lambda *a: None)
        assert not torch_up.runs_class_forward(m)
        handle.remove()
    assert torch_up.runs_class_forward(m)


def test_trl_trainer_methods_and_draw():
    import importlib

    from trl import DistillationTrainer, GRPOTrainer
    from trl.experimental.gkd import GKDTrainer

    for cls in (GRPOTrainer, DistillationTrainer):
        assert callable(getattr(cls, trl_up.TOOL_LOOP)) and callable(getattr(cls, trl_up.SINGLE_TURN))
        params = inspect.signature(getattr(cls, trl_up.SINGLE_TURN)).parameters
        assert list(params)[1:4] == ["prompt_ids", "images", "multimodal_fields"]
    assert "random.random() <= self.lmbda" in inspect.getsource(GKDTrainer.training_step)
    module = importlib.import_module(trl_up.GENERATE_COMPLETIONS[0])
    assert list(inspect.signature(getattr(module, trl_up.GENERATE_COMPLETIONS[1])).parameters)[:3] == [
        "prompts",
        "model",
        "tokenizer",
    ]
    assert trl_up.per_rank_draw_trainer(GKDTrainer.__new__(GKDTrainer))
    assert not trl_up.per_rank_draw_trainer(GRPOTrainer.__new__(GRPOTrainer))


def test_trl_unwrap_signature_and_grpo_padding_attribute():
    import importlib

    from trl import GRPOTrainer

    module = importlib.import_module(trl_up.UNWRAP_FOR_GENERATION[0])
    params = list(inspect.signature(getattr(module, trl_up.UNWRAP_FOR_GENERATION[1])).parameters)
    assert params[:3] == ["model", "accelerator", "gather_deepspeed3_params"]
    assert f"self.{trl_up.PAD_TO_MULTIPLE_OF} = args.pad_to_multiple_of" in inspect.getsource(GRPOTrainer.__init__)


def test_checkpointing_disable_leaves_the_input_grad_hook_and_the_shim_replaces_it():
    """transformers' bug the shim works around (when this first assertion fails, transformers fixed
    it and the shim can go), then the shim: enable, disable, enable keeps one hook."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg)
    hooks = model.get_input_embeddings()._forward_hooks

    def cycle():
        model.gradient_checkpointing_enable()
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable()

    cycle()
    assert len(hooks) == 2
    model.disable_input_require_grads()
    hooks.clear()
    undo = hf_up.replace_input_grad_hooks_on_enable()
    try:
        cycle()
        assert len(hooks) == 1 and len(hf_up.input_grad_hooks(model)) == 1
        del model._require_grads_hooks  # as transformers before the list kept one handle
        model.enable_input_require_grads()
        assert len(hooks) == 1
    finally:
        undo()


def test_trl_module_functions_wrap_and_restore():
    import importlib

    for location in (trl_up.ADD_HOOKS, trl_up.GENERATE_COMPLETIONS, trl_up.UNWRAP_FOR_GENERATION):
        module = importlib.import_module(location[0])
        original = getattr(module, location[1])
        undo = trl_up.wrap_module_function(location, lambda fn: lambda *a, **k: ("wrapped", fn))
        assert getattr(module, location[1])()[1] is original
        undo()
        assert getattr(module, location[1]) is original


def test_real_tensors_leaves_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with torch_up.real_tensors():
            t = torch.ones(2)
    assert type(t) is torch.Tensor and t.sum().item() == 2.0


def test_trl_fused_lm_head_settings_are_read_from_its_closure():
    from transformers import Qwen2ForCausalLM
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    from hf_zero3.testing import models

    model = Qwen2ForCausalLM(models.tiny_qwen2_config(vocab_size=64))
    assert trl_up.fused_lm_head_settings(model) is None  # no head installed
    add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    s = trl_up.fused_lm_head_settings(model)
    assert s["temperature"] == 0.9 and tuple(s["outputs"]) == ("log_probs", "entropy")
    assert s["logit_scale"] == 1.0 and s["final_logit_softcapping"] is None and s["router_aux_loss_coef"] == 0.0
    assert callable(s["original_forward"]) and trl_up.fused_output_class() is FusedCausalLMOutput


def test_inductor_dependent_launch_option_is_a_real_inductor_option():
    """The option the decode step compiles with under ``HF_ZERO3_PDL=on`` exists in this torch's
    inductor config (torch >= 2.9) and is accepted by ``torch.compile``'s options."""
    import torch._inductor.config as inductor_config

    options = torch_up.inductor_dependent_launch_options()
    assert options == {"triton.enable_pdl": True}
    assert inductor_config.triton.enable_pdl is False  # off by default upstream: ours is an opt-in
    with inductor_config.patch(options):
        assert inductor_config.triton.enable_pdl is True


def test_alignment_asserts_option_is_a_real_inductor_option_and_the_loop_compiles_with_it():
    """hf_zero3's compiled functions turn off inductor's alignment asserts (pytorch/pytorch#196226:
    an assert on cuDNN attention's undefined log-sum-exp fails the prompt forward): the option is
    this torch's, on by default, and the prompt forward's and decode step's compiles pass it."""
    import torch._inductor.config as inductor_config

    from hf_zero3.decode import caches, compiled

    options = torch_up.inductor_options_without_alignment_asserts()
    assert options == {"alignment_asserts": False}
    assert inductor_config.alignment_asserts is True  # torch's default: ours turns it off per compile
    seen = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw.get("options"))
        return real(fn, **kw)

    class Probe(torch.nn.Module):
        pass

    def probe(x):
        return x + 1

    try:
        torch.compile = spy
        compiled.compiled_once(probe)
        compiled.compiled_model_call(Probe)
    finally:
        torch.compile = real
        caches.ONCE.pop(probe, None)
        caches.COMPILED.pop((Probe, False), None)
    assert seen == [options, options], seen


def test_triton_ptxas_is_pinned_as_inductor_chooses_it_and_a_set_one_is_kept(monkeypatch):
    """``pin_triton_ptxas`` calls the chooser Inductor runs before it compiles (torch's bundled
    ``_inductor/bin/ptxas`` where the wheel has one, else Triton's own), and keeps a path the user set."""
    import pathlib

    import torch._inductor
    from torch._inductor.runtime import compile_tasks

    assert callable(compile_tasks._set_triton_ptxas_path)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    torch_up.pin_triton_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"

    monkeypatch.delenv("TRITON_PTXAS_PATH")
    compile_tasks._set_triton_ptxas_path.cache_clear()  # it runs once per process otherwise
    torch_up.pin_triton_ptxas()
    bundled = pathlib.Path(torch._inductor.__file__).parent / "bin" / "ptxas"
    assert os.environ.get("TRITON_PTXAS_PATH") == (str(bundled) if bundled.is_file() else None)


def test_static_cache_counters_are_made_on_the_device_before_the_prompt_forward():
    """transformers' StaticLayer keeps its fill count on the CPU until its first update moves it (a
    blocking copy per layer inside a compiled prompt forward); hf_zero3 makes each layer's on the
    forward's device first (here the meta device stands in for a GPU), leaving initialized layers
    and counters already there alone."""
    from transformers.cache_utils import StaticCache

    from hf_zero3.testing import models

    config = models.tiny_llama_config(num_hidden_layers=3)
    cache = StaticCache(config=config, max_cache_len=16)
    before = [layer.cumulative_length for layer in cache.layers]
    assert all(n.device.type == "cpu" for n in before), "transformers now makes the counters elsewhere: recheck"
    cache.layers[2].is_initialized = True  # as after a first update: not touched
    assert hf_up.static_cache_counters_on(cache, torch.device("cpu")) == 0
    assert hf_up.static_cache_counters_on(cache, torch.device("meta")) == 2
    for layer, n in zip(cache.layers[:2], before):
        assert layer.cumulative_length.device.type == "meta" and layer.cumulative_length.shape == n.shape
    assert cache.layers[2].cumulative_length is before[2]
    assert hf_up.static_cache_counters_on(cache, torch.device("meta")) == 0  # already there


def test_a_sliding_window_static_cache_layer_the_call_cannot_fill_becomes_a_static_layer():
    """What ``sliding_layers_unslid`` reads: ``cache_implementation="static"`` builds a
    ``StaticSlidingWindowLayer`` per sliding layer (every layer of Mistral's default config, some of
    a hybrid model's), sized the smaller of the cache and the window; a layer a call fits in (and
    not used yet) becomes a ``StaticLayer`` as long as the cache's longest layer, a shorter one stays."""
    from transformers import MistralConfig, StaticCache, cache_utils

    from hf_zero3.testing import models

    cache = StaticCache(config=MistralConfig(num_hidden_layers=3, sliding_window=32), max_cache_len=48)
    assert [type(x) for x in cache.layers] == [cache_utils.StaticSlidingWindowLayer] * 3
    assert [x.max_cache_len for x in cache.layers] == [32] * 3  # the window
    assert hf_up.sliding_layers_unslid(cache, 40) == 0  # 40 tokens would slide a 32-token window
    cache.layers[1].is_initialized = True  # as after a first update: not touched
    assert hf_up.sliding_layers_unslid(cache, 32) == 2
    assert [type(x).__name__ for x in cache.layers] == ["StaticLayer", "StaticSlidingWindowLayer", "StaticLayer"]
    assert cache.layers[0].max_cache_len == 32 and not cache.layers[0].is_initialized

    config = models.tiny_qwen2_config(use_sliding_window=True, sliding_window=32, max_window_layers=1)
    hybrid = StaticCache(config=config, max_cache_len=48)
    assert [type(x).__name__ for x in hybrid.layers] == ["StaticLayer", "StaticSlidingWindowLayer"]
    assert hf_up.sliding_layers_unslid(hybrid, 20) == 1
    assert [(type(x).__name__, x.max_cache_len) for x in hybrid.layers] == [("StaticLayer", 48)] * 2


def test_lockstep_overrides_only_the_private_generation_methods_upstream_lists():
    """Zero3GenerationMixin's private overrides are exactly hf_zero3._upstream.transformers.OVERRIDDEN,
    and each still exists on GenerationMixin (one of the two encoder hooks) with the same parameters."""
    from transformers.generation.utils import GenerationMixin

    from hf_zero3.generation.lockstep import Zero3GenerationMixin

    own = {n for n in vars(Zero3GenerationMixin) if n.startswith("_") and not n.startswith("__")}
    assert own == set(hf_up.OVERRIDDEN), own ^ set(hf_up.OVERRIDDEN)
    present = [n for n in hf_up.OVERRIDDEN if hasattr(GenerationMixin, n)]
    assert set(hf_up.OVERRIDDEN) - set(present) <= set(hf_up.ENCODER_HOOKS) and len(present) >= len(own) - 1
    for name in present:
        ours, theirs = getattr(Zero3GenerationMixin, name), getattr(GenerationMixin, name)
        takes_all = any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(ours).parameters.values())
        if not takes_all:  # an override spelling out its parameters spells out transformers' own
            assert list(inspect.signature(ours).parameters)[:2] == list(inspect.signature(theirs).parameters)[:2], name


def test_transformers_model_and_config_accessors():
    from transformers import GenerationConfig

    from hf_zero3.testing import models

    model = models.plain_model(models.tiny_llama_config(attn_implementation="sdpa"))
    assert hf_up.is_generation_model(model) and not hf_up.is_generation_model(model.model)
    assert hf_up.can_compile_fullgraph(model) and hf_up.supports_attention_backend(model)
    assert hf_up.attention_implementation(model.config) == "sdpa"
    with hf_up.attention_implementation_set(model.config, "eager"):
        assert hf_up.attention_implementation(model.config) == "eager"
    assert hf_up.attention_implementation(model.config) == "sdpa"
    cfg = GenerationConfig(pad_token_id=3)
    assert hf_up.pad_token_tensor(cfg) is None  # generate() prepares it
    model.generation_config.pad_token_id = 0
    model._prepare_special_tokens(model.generation_config, kwargs_has_attention_mask=True)
    assert int(hf_up.pad_token_tensor(model.generation_config)) == 0
