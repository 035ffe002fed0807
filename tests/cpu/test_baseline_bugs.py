"""The bugs hf_zero3 exists to fix, reproduced with the raw libraries only.

These tests pass when the bug is there: raw ``generate()`` under ZeRO-3 deadlocks when ranks hit
EOS at different steps. If a library release fixes it, they fail, and we learn about it.
"""

import time

import pytest
import torch

from hf_zero3.testing import DistributedFailure, mark, run_ranks


def _raw_generate_then_collective(hf_aware: bool, synced_gpus):
    import torch.distributed as dist
    from _zero3_workers import build_engine
    from fixtures.scenarios import find_eos_scenario

    engine, ref = build_engine(hf_aware=hf_aware)
    sc = find_eos_scenario(ref)
    prompt = sc.early[0][0] if dist.get_rank() == 0 else sc.late[0]
    kwargs = {} if synced_gpus is None else {"synced_gpus": synced_gpus}
    mark(f"generate (EOS expected at step {sc.early[0][1] if dist.get_rank() == 0 else 'never'})")
    with torch.no_grad():
        engine.module.generate(
            torch.tensor([prompt]), max_new_tokens=sc.steps, do_sample=False, eos_token_id=sc.eos_token_id, **kwargs
        )
    mark("after generate: all_reduce")
    dist.all_reduce(torch.ones(1))
    mark("done")


@pytest.mark.parametrize(
    "hf_aware,synced_gpus",
    [
        pytest.param(True, False, id="hf-zero3-config-synced_gpus-False"),
        pytest.param(False, None, id="engine-only-synced_gpus-default"),
    ],
)
def test_raw_generate_deadlocks_on_divergent_eos(hf_aware, synced_gpus):
    start = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_ranks(
            _raw_generate_then_collective, 2, args=(hf_aware, synced_gpus), init="deepspeed", timeout=50, pg_timeout=8
        )
    elapsed = time.monotonic() - start
    assert elapsed < 60
    err = info.value
    # rank 0 finished early and left generate(); rank 1 was still decoding when it failed
    assert err.reports[0].state in ("after generate: all_reduce", "done")
    assert err.reports[1].state.startswith("generate")
    assert err.reports[1].outcome in ("error", "hang")
