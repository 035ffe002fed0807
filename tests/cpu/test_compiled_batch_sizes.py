"""Compiled decoding over several batch sizes on one rank: the second batch size compiles a
batch-dynamic step once (Dynamo's automatic dynamic shapes) and later sizes reuse it. Its own module
so that pytest-xdist can run it beside the other compiled-decode modules."""

import torch

from hf_zero3.testing import run_ranks


def _batch_sizes_rank():
    from _zero3_workers import build_engine

    import hf_zero3

    engine, _ = build_engine(hf_aware=False)
    out = []
    for b in (1, 2, 3, 4, 2):
        ids = torch.randint(3, engine.module.config.vocab_size, (b, 6), generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            hf_zero3.lockstep_generate(
                engine,
                input_ids=ids,
                max_new_tokens=8,
                pad_token_id=0,
                eos_token_id=None,
                gather="all",
                decode="compiled",
            )
        stats = engine.module.hf_zero3_last_generate
        out.append((b, stats.decode, stats.compiles))
    return out


def test_batch_sizes_recompile_once_then_reuse_a_dynamic_step():
    # Dynamo's automatic dynamic shapes: the second batch size compiles a batch-dynamic step once
    (r,) = run_ranks(_batch_sizes_rank, 1, init="deepspeed", timeout=300, pg_timeout=60)
    assert [d for _, d, _ in r] == ["compiled"] * 5
    assert [c > 0 for _, _, c in r] == [True, True, False, False, False], r
