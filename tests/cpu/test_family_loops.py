"""The model families RL recipes train beyond dense Llama take hf_zero3's static loop, with the
tokens of transformers' own ``generate``: MoE (Qwen3-MoE, Mixtral, gpt-oss), a sliding window far
shorter than the call (Gemma 3, Mistral, gpt-oss, a hybrid Qwen2), Phi-3 (its own generation
inputs), and a hybrid linear-attention model (Qwen3.5). Each is built plainly and partitioned by
``deepspeed.initialize`` (strict ZeRO-3, 2 gloo ranks, fp32), prompted with left-padded prompts of
a different length on each rank, and stopped at an EOS that ends its rows at different steps, with
``min_new_tokens`` and ``repetition_penalty`` on."""

import pytest

from hf_zero3.testing import mark, run_ranks

WINDOW = 4  # the sliding models' window: 8x shorter than prompt + completion (8 + 24 tokens)
PROMPT, NEW = 8, 24
FAMILIES = {
    # router logits on, as TRL's GRPO sets them for its auxiliary loss: the loop's steps ask for none
    "qwen3_moe": ("tiny_qwen3_moe_config", {"output_router_logits": True}),
    "mixtral": ("tiny_mixtral_config", {}),
    "phi3": ("tiny_phi3_config", {}),
    "qwen3_5": ("tiny_qwen3_5_config", {}),
    "gemma3": ("tiny_gemma3_config", {"sliding_window": WINDOW}),
    # a window longer than the prompt: the ring starts part empty
    "gemma3_window_12": ("tiny_gemma3_config", {"sliding_window": 12}),
    "mistral": ("tiny_mistral_config", {"sliding_window": WINDOW}),
    "qwen2_hybrid": (
        "tiny_qwen2_config",
        {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": WINDOW},
    ),
    "gpt_oss": ("tiny_gpt_oss_config", {"sliding_window": WINDOW}),
}


def _family_rank(names):
    import torch
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.decode import static_loop
    from hf_zero3.decode.compiled import forward_kwargs

    rank = dist.get_rank()
    out = {}
    for name in names:
        config, overrides = FAMILIES[name]
        mark(f"{name}: build")
        engine, ref = build_engine(config, hf_aware=False, **overrides)
        # transformers' own generate cannot decode a padded batch with router logits on (its
        # load-balancing loss meets the whole mask with one token's routing): its tokens without them
        ref.config.output_router_logits = False
        torch.manual_seed(rank)
        ids = torch.randint(3, 90, (3, PROMPT))
        mask = torch.ones_like(ids)
        # left padding, a different length on each rank, reaching into the first steps' windows
        ids[0, : 5 + rank], mask[0, : 5 + rank] = 0, 0
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, do_sample=False)
        with torch.no_grad():
            free = ref.generate(**gen, eos_token_id=None)
        # an EOS that row 0 reaches early and the others later or never: rows end at different steps
        eos = int(free[0, PROMPT + 3])
        gen.update(eos_token_id=eos, min_new_tokens=2, repetition_penalty=1.3)
        with torch.no_grad():
            reference = ref.generate(**gen)
        mark(f"{name}: lockstep")
        opts = hf_zero3.DecodeOptions(compile_prefill=False)
        with torch.no_grad():
            got = hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", decode_options=opts, **gen)
        s = engine.module.hf_zero3_last_generate
        r = s.decode_report
        out[name] = dict(
            out=got.tolist(),
            reference=reference.tolist(),
            loop=s.loop,
            loop_reason=s.loop_reason,
            step=s.step,
            step_failure=static_loop.failure(engine.module),
            experts=r.experts,
            ring_layers=r.ring_layers,
            linear_attention_layers=r.linear_attention_layers,
            ended=[int((row[PROMPT:] == eos).any()) for row in reference],
            router_logits=forward_kwargs(engine.module).get("output_router_logits"),
        )
        if name == "qwen3_5":  # the prompt forward asked compiled: eager for linear-attention layers, and why
            with torch.no_grad():
                again = hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", **gen)
            s = engine.module.hf_zero3_last_generate
            out[name].update(again=again.tolist(), prefill=s.prefill, prefill_reason=s.prefill_reason)
    return out


#: Two groups of ranks: every model class's compiled step is a recompile of ``nn.Module.__call__``,
#: whose Dynamo cache holds 8 entries a process (``recompile_limit``), fewer than the classes here.
GROUPS = (
    ("qwen3_moe", "mixtral", "phi3", "qwen3_5"),
    ("gemma3", "gemma3_window_12", "mistral", "qwen2_hybrid", "gpt_oss"),
)


@pytest.fixture(scope="module")
def family_results():
    assert sorted(n for g in GROUPS for n in g) == sorted(FAMILIES)
    parts = [run_ranks(_family_rank, 2, args=(list(g),), timeout=480, pg_timeout=120) for g in GROUPS]
    return [{k: v for part in ranks for k, v in part.items()} for ranks in zip(*parts)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_decodes_on_hf_zero3s_loop_with_transformers_tokens(family_results, name):
    for r in family_results:
        c = r[name]
        assert c["loop"] == "hf_zero3" and c["loop_reason"] is None and c["step"] == "compiled", c
        assert c["out"] == c["reference"], c


def test_rows_end_at_different_steps_on_each_rank(family_results):
    """The EOS picked ends some rows and not others somewhere, so the loop's EOS masking runs."""
    assert any(0 < sum(r[n]["ended"]) < len(r[n]["ended"]) for r in family_results for n in FAMILIES)


def test_the_report_says_what_each_family_ran(family_results):
    for r in family_results:
        for name in ("qwen3_moe", "mixtral", "gpt_oss"):
            assert r[name]["experts"] is not None, r[name]
        for name in ("gemma3", "gemma3_window_12", "mistral", "qwen2_hybrid", "gpt_oss"):
            assert r[name]["ring_layers"] > 0, r[name]  # the window slid, as a ring
        q = r["qwen3_5"]
        assert q["linear_attention_layers"] == 3 and q["again"] == q["reference"], q
        assert q["prefill"] == "eager" and "linear-attention layers" in q["prefill_reason"], q
        assert r["phi3"]["experts"] is None and r["phi3"]["ring_layers"] == 0
        assert r["qwen3_moe"]["router_logits"] is False and r["mixtral"]["router_logits"] is False
