"""TRL's GRPO with ``Zero3Safe(decode="compiled")`` on 2 gloo ranks under strict ZeRO-3 (TRL gathers
the model for its rollouts): the rollouts take the compiled path, the static loop where TRL's
sampling settings allow it, transformers' loop with its reason where a Python logits processor
does not, and both ranks train alike. Its own module so that pytest-xdist can run it beside the
other compiled-decode modules."""

import pytest

from hf_zero3.testing import run_ranks


def _grpo_compiled_rank(tmpdir: str, diverge_eos: bool):
    """TRL's GRPO (TRL gathers the model for its rollouts) with Zero3Safe(decode="compiled")."""
    import hf_zero3
    from hf_zero3.testing import trl_jobs

    trainer = trl_jobs.grpo_trainer(tmpdir, diverge_eos=diverge_eos, callbacks=[hf_zero3.Zero3Safe(decode="compiled")])
    trainer.train()
    last = hf_zero3.runtime_of(trainer.model).last_generate
    res = trl_jobs._result(trainer)
    return dict(
        decode=last.decode,
        reason=last.decode_reason,
        gather=last.gather,
        losses=res["losses"],
        forwards=res["forwards_per_call"],
        loop=last.loop,
        loop_reason=last.loop_reason,
    )


@pytest.mark.parametrize("diverge_eos", [False, True])
def test_trl_grpo_rollouts_take_the_compiled_path(tmp_path, diverge_eos):
    r0, r1 = run_ranks(
        _grpo_compiled_rank, 2, args=(str(tmp_path), diverge_eos), init="deepspeed", timeout=420, pg_timeout=60
    )
    for r in (r0, r1):
        assert r["gather"] == "held" and r["decode"] == "compiled", r
        if diverge_eos:  # the harness's rank-keyed EOS script is a Python logits processor: transformers' loop
            assert r["loop"] == "transformers" and "_Scripted" in r["loop_reason"], r
        else:  # TRL's default sampling settings are ones the static loop runs
            assert r["loop"] == "hf_zero3", r["loop_reason"]
        assert len(r["losses"]) == 2 and all(x == x for x in r["losses"])
    assert r0["forwards"] == r1["forwards"] and r0["losses"] == r1["losses"]
