"""Compiled decoding over prompt lengths in several cache buckets on one rank: lengths within a
bucket reuse every graph, the first call in a second bucket compiles once more with the cache
length dynamic (Dynamo's automatic dynamic shapes), and later buckets reuse that. Its own module so
that pytest-xdist can run it beside the other compiled-decode modules."""

import torch

from hf_zero3.testing import run_ranks

NEW = 16
PROMPTS = (12, 20, 60, 70, 130)  # prompt + new tokens 28, 36 | 76, 86 | 146: buckets of 64, 128, 192


def _buckets_rank():
    from _zero3_workers import build_engine

    import hf_zero3

    engine, ref = build_engine(hf_aware=False)
    out = []
    for p in PROMPTS:
        ids = torch.randint(3, engine.module.config.vocab_size, (2, p), generator=torch.Generator().manual_seed(p))
        kw = dict(input_ids=ids, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            got = hf_zero3.lockstep_generate(engine, gather="all", decode="compiled", **kw)
            want = ref.generate(**kw)
        stats = engine.module.hf_zero3_last_generate
        out.append((p, stats.decode, stats.compiles, torch.equal(got, want)))
    return out


def test_a_second_cache_bucket_compiles_once_then_later_buckets_reuse():
    (r,) = run_ranks(_buckets_rank, 1, init="deepspeed", timeout=400, pg_timeout=60)
    assert [d for _, d, _, _ in r] == ["compiled"] * len(PROMPTS), r
    assert [c > 0 for _, _, c, _ in r] == [True, False, True, False, False], r
    assert all(same for *_, same in r), r
