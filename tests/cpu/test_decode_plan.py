"""One function decides a call's decode path (:func:`hf_zero3.decode.plan.plan`), and the three
places a user reads why (``hf_zero3 env --model ... --call ...``, the call's warning and its report
``hf_zero3_last_generate``) print its reason as it is: one test per fallback reason.

The calls run through lockstep on a real ZeRO-3 engine (one gloo rank, tiny Llama, partitioned by
``deepspeed.initialize``) with ``decode="compiled"``, which plans on the CPU as ``"auto"`` plans on
CUDA; ``hf_zero3 env`` plans the same call for the model built on the meta device. A reason that
comes from an object only a call has (a cache or streamer passed in, a stopping criterion, a
logits processor) cannot reach ``env``: there the warning and the report agree."""

import logging

import pytest

from hf_zero3.testing import run_ranks

PROMPT = 6

#: (name, generate() keywords, the part that falls back, the reason every place prints)
ENV_SCENARIOS = [
    ("eager", dict(decode="eager"), "step", "decode='eager'"),
    ("beam_search", dict(num_beams=2), "step", "beam search (num_beams > 1)"),
    ("another_cache", dict(cache_implementation="dynamic"), "step", "cache_implementation='dynamic'"),
    ("no_max_new_tokens", dict(max_new_tokens=None, max_length=12), "step", "max_new_tokens is not set"),
    ("no_cache", dict(use_cache=False), "step", "use_cache=False"),
    ("disable_compile", dict(decode="auto", disable_compile=True), "step", "disable_compile=True"),
    ("layerwise_gather", dict(gather="layerwise"), "step", "the model is gathered 'layerwise'"),
    (
        "per_step_outputs",
        dict(return_dict_in_generate=True, output_scores=True),
        "loop",
        "return_dict_in_generate with output_scores (per-step outputs)",
    ),
]
#: reasons from objects only a call holds: (name, what the rank passes, part, reason)
CALL_SCENARIOS = [
    ("cache_passed", "cache", "step", "a cache was passed in"),
    ("streamer", "streamer", "loop", "a streamer was passed"),
    ("stopping_criterion", "criterion", "loop", "stopping criterion StopAtThree is not one the loop computes"),
]


def _plan_rank(env_scenarios, call_scenarios):
    import torch
    from _zero3_workers import build_engine
    from transformers import DynamicCache, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    import hf_zero3

    class StopAtThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT + 3, dtype=torch.bool)

    class Quiet(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    engine, _ = build_engine("tiny_llama_config")
    ids = torch.randint(3, 90, (2, PROMPT))
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("hf_zero3.generation")
    logger.addHandler(Said())
    logger.setLevel(logging.INFO)  # a fallback on the CPU is said at INFO (a warning on CUDA)

    def run(kw):
        del said[:]
        kw = {"gather": "all", "decode": "compiled", "max_new_tokens": 4, **kw}
        if kw["max_new_tokens"] is None:
            del kw["max_new_tokens"]
        with torch.no_grad():
            hf_zero3.lockstep_generate(engine, input_ids=ids, pad_token_id=0, eos_token_id=None, **kw)
        s = engine.module.hf_zero3_last_generate
        return dict(step=s.decode_reason, loop=s.loop_reason, said=list(said))

    out = {name: run(kw) for name, kw, _, _ in env_scenarios}
    objects = {
        "cache": lambda: dict(past_key_values=DynamicCache()),
        "streamer": lambda: dict(streamer=Quiet()),
        "criterion": lambda: dict(stopping_criteria=[StopAtThree()]),
    }
    for name, what, _, _ in call_scenarios:
        out[name] = run(objects[what]())
    return out


@pytest.fixture(scope="module")
def planned():
    return run_ranks(_plan_rank, 1, args=(ENV_SCENARIOS, CALL_SCENARIOS), timeout=300, pg_timeout=60)[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from hf_zero3.testing import models

    path = tmp_path_factory.mktemp("llama")
    models.tiny_llama_config().save_pretrained(path)
    return str(path)


def _said(got: dict, reason: str) -> list[str]:
    return [m for m in got["said"] if reason in m]


@pytest.mark.parametrize("name,kw,part,reason", ENV_SCENARIOS, ids=[s[0] for s in ENV_SCENARIOS])
def test_env_the_warning_and_the_report_give_the_plans_reason(planned, llama_dir, name, kw, part, reason):
    from hf_zero3 import env

    got = planned[name]
    reported = got[part]
    assert reported is not None and reported.startswith(reason), got
    other = got["loop" if part == "step" else "step"]
    assert other is None or part == "loop", got  # an eager step has no loop part
    assert _said(got, reported), got  # the warning prints the report's reason, whole
    call = {"decode": "compiled", **kw}
    rows = {r["name"]: r for r in env.report(llama_dir, call)["model"]}
    assert rows[f"decode {part}"]["note"] == reported, (rows, got)
    assert rows["decode step"]["value"] == ("eager" if part == "step" else "compiled"), rows


@pytest.mark.parametrize("name,what,part,reason", CALL_SCENARIOS, ids=[s[0] for s in CALL_SCENARIOS])
def test_a_calls_own_objects_give_one_reason_in_the_warning_and_the_report(planned, name, what, part, reason):
    got = planned[name]
    assert got[part] == reason, got
    assert _said(got, reason), got


def test_env_plans_the_fast_path_for_a_plain_call(llama_dir):
    from hf_zero3 import env

    rows = {r["name"]: r for r in env.report(llama_dir)["model"]}
    assert rows["decode step"]["value"] == "compiled" and rows["decode step"]["note"] == ""
    assert rows["decode loop"]["value"] == "hf_zero3" and rows["decode loop"]["note"] == ""


def test_env_reads_call_keywords_as_literals():
    from hf_zero3.env import _call_keywords

    assert _call_keywords(["num_beams=2", "use_cache=False", "gather=layerwise"]) == dict(
        num_beams=2, use_cache=False, gather="layerwise"
    )
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _call_keywords(["num_beams"])
