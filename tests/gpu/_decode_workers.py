"""Rank-side code for the compiled-decode GPU tests (issue #14; NCCL, one GPU a rank): the 4-layer
bf16 Llama of _deepcompile_workers under plain ZeRO-3 (no DeepCompile), rows ending at per-rank steps."""

from __future__ import annotations

import torch
from _deepcompile_workers import build


def compiled_decode(new_tokens: int = 48):
    import os

    import torch.distributed as dist

    import hf_zero3

    # the Triton decode attention also at this test's batch (4 rows x 8 key/value heads: fewer
    # programs than SMs, where "auto" keeps the PyTorch form), so the test runs it end to end
    os.environ["HF_ZERO3_TRITON_ATTENTION"] = "always"
    os.environ.pop("HF_ZERO3_FUSE_ROPE", None)  # the default: the rotary embedding and cache write inside

    rank = dist.get_rank()
    engine = build(deepcompile=False, compile_=False, torch_adam=True)
    engine.eval()
    module = engine.module
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 32000, (4, 24 + 4 * rank), generator=g).to(engine.device)  # prompt length differs per rank
    kw = dict(max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2)
    out = {}
    with torch.no_grad():
        res = hf_zero3.lockstep_generate(
            engine,
            input_ids=ids,
            gather="all",
            decode="compiled",
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
        stats = module.hf_zero3_last_generate
        out["first"] = dict(
            decode=stats.decode, reason=stats.decode_reason, compiles=stats.compiles, forwards=stats.forwards
        )
        # teacher-forced: one eager forward (whole model gathered) over the compiled call's sequence
        seq = res.sequences
        with hf_zero3.eval_forward(engine, gather="all"):
            eager = module(input_ids=seq).logits.float()
        steps = len(res.logits)
        eager_steps = eager[:, ids.shape[1] - 1 : ids.shape[1] - 1 + steps]
        compiled_steps = torch.stack([lg.float() for lg in res.logits], dim=1)
        diff = (eager_steps - compiled_steps).abs().max().item()
        scale = eager_steps.abs().max().item()
        out["teacher_forced"] = dict(max_abs_diff=diff, max_abs_logit=scale)
        # hf_zero3's static loop with CUDA graphs (no return_dict): a stop agreement every 4 steps;
        # teacher-forced, each chosen token is the eager forward's argmax within the bf16 tolerance
        seq = hf_zero3.lockstep_generate(
            engine, input_ids=ids, gather="all", decode="compiled", do_sample=False, sync_every=4, graph_steps=8, **kw
        )
        out["graphs"] = _call_report(module.hf_zero3_last_generate)
        # the same call again, back to back, twice: the same tokens, and the graphs an earlier call
        # captured replay once the new call's cache tensors land where that call's were (a loop's
        # first call allocates around its compiles, so the call after it may capture once more)
        again = [
            hf_zero3.lockstep_generate(
                engine,
                input_ids=ids,
                gather="all",
                decode="compiled",
                do_sample=False,
                sync_every=4,
                graph_steps=8,
                **kw,
            )
            for _ in range(2)
        ]
        out["again"] = dict(
            same=all(bool(torch.equal(a, seq)) for a in again), reused=module.hf_zero3_last_generate.graphs_reused
        )
        # a stop agreement before every step (sync_every=1): graphs of one step between agreements,
        # the same tokens
        every_step = hf_zero3.lockstep_generate(
            engine, input_ids=ids, gather="all", decode="compiled", do_sample=False, sync_every=1, graph_steps=8, **kw
        )
        out["sync1"] = dict(same=bool(torch.equal(every_step, seq)), loop=module.hf_zero3_last_generate.loop)
        out["graphs_teacher_forced"] = _teacher_forced(engine, seq, ids.shape[1], kw["eos_token_id"])
        # another prompt length in the same 64-token bucket: no recompile; the graphs replay only
        # where the parameters and every cache tensor are those they were captured with
        short = ids[:, :-2]
        seq = hf_zero3.lockstep_generate(engine, input_ids=short, gather="all", decode="compiled", **kw)
        st = module.hf_zero3_last_generate
        out["second"] = dict(
            compiles=st.compiles,
            loop=st.loop,
            reused=st.graphs_reused,
            teacher_forced=_teacher_forced(engine, seq, short.shape[1], kw["eos_token_id"]),
        )
        # sampling with a fixed seed, twice: identical tokens
        samples = []
        for _ in range(2):
            torch.manual_seed(1234)
            samples.append(
                hf_zero3.lockstep_generate(
                    engine, input_ids=ids, gather="all", decode="compiled", do_sample=True, top_k=20, **kw
                ).tolist()
            )
        out["sampling_reproducible"] = samples[0] == samples[1]
        out["sampling_loop"] = module.hf_zero3_last_generate.loop
        # the processors the loop computes (repetition_penalty, min_new_tokens) with sampling, captured
        # in CUDA graphs and run step by step (graph_steps=0): the same tokens, and the default late checks
        captured, stepped, st = _sampled_captured_and_stepped(
            engine, ids, 99, gather="all", decode="compiled", min_new_tokens=6, **kw
        )
        out["processors"] = dict(
            loop=st.loop, graph_steps=st.graph_steps, late=st.late_checks, same=captured == stepped
        )
    return out


def check_graphs_replay_the_steps(res: list, step: str) -> None:
    """What every :func:`eager_step_graphs` run must show (``step``: the call's step kind): the
    captured graphs replay on the next call, they give the tokens of the steps run one by one and
    of seeded sampling, each token is the eager forward's argmax within the bf16 tolerance
    (teacher-forced), and the ranks ran as many forwards."""
    for r in res:
        g, plain, again = r["graphs"], r["plain"], r["again"]
        assert g["graph_steps"] == 8 and plain["graph_steps"] == 0, (g, plain)
        assert r["default"]["graph_steps"] == (1 if step == "eager" else 8), r["default"]
        assert again["reused"] and again["compiles"] == 0, again  # the captured graphs replay
        assert r["same"], r
        tf = r["teacher_forced"]
        assert tf["tokens"] > 0 and tf["max_margin"] <= 0.05 * max(1.0, tf["max_abs_logit"]), tf
        assert r["sampled_same"] and r["sampled_step"] == step, r
    assert len({r["graphs"]["forwards"] for r in res}) == 1


def _sampled_captured_and_stepped(engine, ids, seed: int, **kw) -> tuple[list, list, object]:
    """Sampling with the processors the loop computes (top-p, repetition_penalty), the same seed,
    captured in CUDA graphs of 8 steps and run step by step: (both token lists, the captured call's
    report)."""
    import copy

    import hf_zero3

    out, report = [], None
    for steps in (8, 0):
        torch.manual_seed(seed)
        out.append(
            hf_zero3.lockstep_generate(
                engine, input_ids=ids, do_sample=True, top_p=0.9, repetition_penalty=1.3, graph_steps=steps, **kw
            ).tolist()
        )
        if steps:
            report = copy.copy(engine.module.hf_zero3_last_generate)  # the captured call's, as it ended
    return out[0], out[1], report


def _call_report(st) -> dict:
    """What a lockstep call's report (``hf_zero3_last_generate``) says about its decode path."""
    r = st.decode_report
    return dict(
        loop=st.loop,
        reason=st.loop_reason,
        decode=st.decode,
        step=st.step,
        prefill=st.prefill,
        prefill_reason=st.prefill_reason,
        compiles=st.compiles,
        graph_steps=st.graph_steps,
        reused=st.graphs_reused,
        forwards=st.forwards,
        attention=r.attention,
        mlp_kernels=r.mlp_kernels,
        split_k=r.split_k,
        rope_attention=r.rope_attention,
        dependent_launches=r.dependent_launches,
        qkv_partials=r.qkv_partials,
        compiled_layers=r.compiled_layers,
        ring_layers=r.ring_layers,
        norm_kernels=r.norm_kernels,
        rotary_kernel=r.rotary_kernel,
    )


def _teacher_forced(engine, seq, p: int, eos: int) -> dict:
    """One eager forward over a generated sequence: how far each chosen token's logit is below the
    eager argmax (bf16: within a tolerance, not identity), up to each row's first EOS."""
    import hf_zero3

    with hf_zero3.eval_forward(engine, gather="all"):
        eager = engine.module(input_ids=seq).logits.float()
    gen = seq[:, p:]
    pred = eager[:, p - 1 : p - 1 + gen.shape[1]]
    valid = torch.cumsum(torch.cumsum((gen == eos).long(), 1), 1) <= 1
    margin = (pred.max(-1).values - pred.gather(-1, gen[..., None]).squeeze(-1))[valid]
    return dict(max_margin=margin.max().item(), max_abs_logit=pred.abs().max().item(), tokens=int(valid.sum()))


def eager_step_graphs(new_tokens: int = 40, layers: bool = False, mistral: bool = False, window: int | None = None):
    """The static loop with ``compile_step=False``: the model's own forward (with hf_zero3's
    kernels) runs the decode steps, captured in CUDA graphs; against the same steps run one by one
    (``graph_steps=0``) and the eager forward over the sequence (teacher-forced). ``layers``: the
    same with ``compile_layers=True`` (each decoder layer through one compiled layer). ``mistral``:
    the Llama's sizes as a Mistral with its default 4096-token sliding window (``window``: that
    window instead)."""
    import os

    import torch.distributed as dist

    import hf_zero3
    from hf_zero3.testing import models

    os.environ["HF_ZERO3_TRITON_ATTENTION"] = "always"  # the rope kernel too at this small batch
    os.environ.pop("HF_ZERO3_FUSE_ROPE", None)
    rank = dist.get_rank()
    config = models.small_mistral_config(**({"sliding_window": window} if window else {})) if mistral else None
    engine = build(deepcompile=False, compile_=False, torch_adam=True, config=config)
    engine.eval()
    module = engine.module
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 32000, (4, 24 + 4 * rank), generator=g).to(engine.device)
    options = hf_zero3.DecodeOptions(compile_step=layers, compile_layers=layers, compile_prefill=False)
    kw = dict(gather="all", decode="compiled", max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2, sync_every=4)
    out = {}
    with torch.no_grad():
        runs = {}
        # "again" twice: the call after a loop's first may capture once more (see compiled_decode)
        # "default": graph_steps unset (an eager step's graphs hold one step, a compiled one's 8)
        for name, steps in (("graphs", 8), ("plain", 0), ("again", 8), ("again", 8), ("default", None)):
            runs[name] = hf_zero3.lockstep_generate(
                engine, input_ids=ids, do_sample=False, graph_steps=steps, decode_options=options, **kw
            )
            out[name] = _call_report(module.hf_zero3_last_generate)
        out["same"] = all(bool(torch.equal(runs["graphs"], runs[n])) for n in ("plain", "again", "default"))
        out["teacher_forced"] = _teacher_forced(engine, runs["graphs"], ids.shape[1], kw["eos_token_id"])
        # sampling with processors, captured and step by step: the same tokens for the same seed
        captured, stepped, st = _sampled_captured_and_stepped(engine, ids, 7, decode_options=options, **kw)
        out["sampled_same"], out["sampled_step"] = captured == stepped, st.step
    return out
