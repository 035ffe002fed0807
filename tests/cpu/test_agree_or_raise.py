"""No hangs, no silent truncation (issue #11): every rank raises the same named error, quickly.

Real DeepSpeed ZeRO-3 engines (strict settings, models built plainly and handed to
``deepspeed.initialize``) on 2 and 3 gloo ranks. Each finding of the issue has a scenario here,
and the rows that used to hang or truncate keep a control that shows the raw behaviour.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from hf_zero3.testing import DistributedFailure, mark, run_ranks

FAST = 5.0  # seconds: an error shared by agreement must arrive well before any timeout

# -- finding 1: an error on one rank is every rank's -------------------------------------------

#: kwargs that the *last* rank passes to lockstep_generate on top of a valid call
BAD_ARGUMENTS = {
    "stop_typo": {"stop": "eventually"},  # hf_zero3's own refusals
    "assisted_decoding": {"prompt_lookup_num_tokens": 2},
    "max_time_with_fixed": {"max_time": 5.0, "stop": "fixed"},
    "max_length_budget": {"max_new_tokens": None, "max_length": 3},
    "stop_strings_without_tokenizer": {"stop_strings": ["x"]},  # transformers' own checks
    "num_return_sequences": {"num_return_sequences": 3},
    "max_new_tokens_0": {"max_new_tokens": 0},
    "empty_batch": {"input_ids": torch.zeros((0, 4), dtype=torch.long)},
    "decode_switch_typo": {"env": {"HF_ZERO3_FUSE_ROPE": "maybe"}},  # read inside the call
}


def _one_rank_bad_argument():
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.errors import RankFailure

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, ref = build_engine(hf_aware=False)
    ids = torch.tensor([[5 + rank, 6, 7, 8]])
    out = {}
    for name, bad in BAD_ARGUMENTS.items():
        mark(f"bad argument {name}")
        kw = dict(input_ids=ids, max_new_tokens=4, pad_token_id=0, eos_token_id=None)
        env = {}
        if rank == world - 1:
            bad = dict(bad)
            env = bad.pop("env", {})
            kw.update(bad)
            kw = {k: v for k, v in kw.items() if v is not None}
        os.environ.update(env)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                hf_zero3.lockstep_generate(engine, **kw)
            out[name] = dict(raised=None)
        except Exception as exc:  # noqa: BLE001 - what every rank raised is the result
            out[name] = dict(
                raised=type(exc).__name__,
                shared=isinstance(exc, RankFailure),
                message=str(exc),
                value_error=isinstance(exc, ValueError),
                seconds=time.perf_counter() - start,
            )
        finally:
            for key in env:
                del os.environ[key]
    mark("a clean call after every failure")
    with torch.no_grad():
        got = hf_zero3.lockstep_generate(engine, input_ids=ids, max_new_tokens=4, pad_token_id=0, eos_token_id=None)
        exp = ref.generate(input_ids=ids, max_new_tokens=4, pad_token_id=0, eos_token_id=None, do_sample=False)
    out["clean_after"] = got.tolist() == exp.tolist()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def bad_argument_results(request):
    return request.param, run_ranks(_one_rank_bad_argument, request.param, timeout=240, pg_timeout=20)


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_one_ranks_bad_argument_is_raised_on_every_rank(bad_argument_results, case):
    world, results = bad_argument_results
    bad_rank = world - 1
    messages = {r[case]["message"] for r in results}
    for rank, r in enumerate(results):
        res = r[case]
        assert res["raised"] is not None and res["shared"], (rank, res)
        assert res["seconds"] < FAST, (rank, res["seconds"])
        assert f"rank {bad_rank} " in res["message"]
    assert len(messages) == 1, messages  # the same error, word for word, on every rank


def test_refusals_stay_value_errors(bad_argument_results):
    _, results = bad_argument_results
    for r in results:
        for case in (
            "stop_typo",
            "assisted_decoding",
            "max_time_with_fixed",
            "empty_batch",
            "max_new_tokens_0",
            "decode_switch_typo",
        ):
            assert r[case]["value_error"], (case, r[case])  # `except ValueError` keeps working
        assert "HF_ZERO3_FUSE_ROPE='maybe' is not a switch" in r["decode_switch_typo"]["message"]


def test_group_still_generates_correctly_after_the_failures(bad_argument_results):
    _, results = bad_argument_results
    assert all(r["clean_after"] for r in results)


def _raw_bad_argument_control():
    """The same bad argument with transformers alone: the healthy rank is left waiting."""
    import torch.distributed as dist
    from _zero3_workers import build_engine

    engine, _ = build_engine(hf_aware=False)
    kw = dict(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    if dist.get_rank() == 1:
        kw["max_new_tokens"] = 0
    mark("raw generate")
    with torch.no_grad():
        engine.module.generate(**kw)


def test_control_raw_generate_leaves_the_healthy_rank_with_a_gloo_error():
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_raw_bad_argument_control, 2, timeout=60, pg_timeout=8)
    r0, r1 = info.value.reports
    assert r1.outcome == "error" and "ValueError" in r1.error
    assert r0.outcome in ("error", "hang", "died")
    # the healthy rank gets a raw transport error from inside DeepSpeed's all-gather, not rank 1's error
    assert "RankFailure" not in r0.error and "ValueError" not in r0.error
    if r0.outcome == "error":
        assert r0.error.strip().splitlines()[-1].startswith("RuntimeError"), r0.error[-300:]


def _seq2seq_long_prompt_on_one_rank(tmpdir):
    """Seq2SeqTrainer(predict_with_generate=True, generation_max_length=14), one 15-token prompt."""
    import torch.distributed as dist
    from fixtures.trainer_job import make_trainer

    from hf_zero3 import Zero3Safe
    from hf_zero3.errors import RankFailure

    trainer = make_trainer(f"{tmpdir}/s2s", callbacks=[Zero3Safe()], max_steps=1, seq2seq=True)
    trainer.train()

    class Prompts(torch.utils.data.Dataset):
        rows = [torch.arange(10, 13), torch.arange(10, 25)]  # rank 0: 3 tokens, rank 1: 15 > 14

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}

    mark("predict with generate")
    start = time.perf_counter()
    try:
        trainer.predict(Prompts())
        return dict(raised=None)
    except Exception as exc:  # noqa: BLE001
        return dict(
            raised=type(exc).__name__,
            shared=isinstance(exc, RankFailure),
            message=str(exc),
            seconds=time.perf_counter() - start,
            rank=dist.get_rank(),
        )


def test_seq2seq_trainer_long_prompt_on_one_rank_raises_everywhere(tmp_path):
    res = run_ranks(
        _seq2seq_long_prompt_on_one_rank, 2, args=(str(tmp_path),), init="deepspeed", timeout=200, pg_timeout=30
    )
    assert len({r["message"] for r in res}) == 1
    for r in res:
        assert r["shared"] and "rank 1 " in r["message"] and r["seconds"] < FAST, r


# -- finding 2 and 3: ranks out of step, options that differ ---------------------------------------


def _out_of_step():
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.errors import RankDivergenceError, Zero3Error

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    ids = torch.tensor([[5 + rank, 6, 7, 8]])
    gen = dict(input_ids=ids, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    out = {}

    def attempt(name, fn):
        mark(name)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                fn()
            out[name] = dict(raised=None)
        except Exception as exc:  # noqa: BLE001
            out[name] = dict(
                raised=type(exc).__name__,
                divergence=isinstance(exc, RankDivergenceError),
                message=str(exc),
                seconds=time.perf_counter() - start,
            )

    attempt("stop_differs", lambda: hf_zero3.lockstep_generate(engine, stop="fixed" if rank == 0 else "sync", **gen))
    attempt("sync_every_differs", lambda: hf_zero3.lockstep_generate(engine, sync_every=1 + rank, **gen))
    attempt(
        "gather_differs", lambda: hf_zero3.lockstep_generate(engine, gather="all" if rank == 0 else "layerwise", **gen)
    )
    # an extra generate() on rank 0; rank 1's next hf_zero3 operation is an eval region
    hf_zero3.lockstep(engine)

    def extra_call():
        engine.module.generate(**gen)
        if rank == 0:
            engine.module.generate(**gen)
        with hf_zero3.eval_forward(engine):
            engine.module(ids)

    attempt("extra_generate_on_one_rank", extra_call)

    # the pattern agree-or-raise makes safe: a caught error, then the same call again everywhere
    results = []

    def retry():
        for bad in (rank == 0, False):
            try:
                results.append(hf_zero3.lockstep_generate(engine, **{**gen, "max_new_tokens": 0 if bad else 6}))
            except Zero3Error:
                results.append(None)

    attempt("retry_after_shared_error", retry)
    with torch.no_grad():
        exp = ref.generate(**gen, do_sample=False)
    out["retry_outputs"] = [None if r is None else r.tolist() == exp.tolist() for r in results]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def out_of_step_results(request):
    return run_ranks(_out_of_step, request.param, timeout=200, pg_timeout=20)


@pytest.mark.parametrize(
    "case,differs",
    [
        ("stop_differs", "stop"),
        ("sync_every_differs", "sync_every"),
        ("gather_differs", "gather"),
        ("extra_generate_on_one_rank", "operation"),
    ],
)
def test_ranks_out_of_step_raise_a_named_divergence_quickly(out_of_step_results, case, differs):
    for r in out_of_step_results:
        res = r[case]
        assert res["divergence"], res
        assert f"They differ in: {differs}" in res["message"] and res["seconds"] < FAST, res
        assert "rank 0 is in" in res["message"] and "rank 1 is in" in res["message"]


def test_a_shared_error_lets_every_rank_retry_in_step(out_of_step_results):
    for r in out_of_step_results:
        assert r["retry_after_shared_error"]["raised"] is None
        assert r["retry_outputs"] == [None, True]  # every rank failed the first call, got the second right


def _untagged_agreements_control():
    """The pre-#11 protocol: agreements of different sizes, no header. One rank is one call ahead."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.tensor([6, -6]))  # its next call's budget agreement
    else:
        dist.all_reduce(torch.tensor([1]))  # the other's stop agreement
    dist.barrier()


def test_control_untagged_agreements_of_different_sizes_abort():
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_untagged_agreements_control, 2, timeout=40, pg_timeout=8)
    assert any(r.outcome in ("died", "error") for r in info.value.reports)


def _missing_rank(flag_dir: str, case: str):
    """Rank 0 runs an hf_zero3 call that rank 1 never makes; the agreement timeout names rank 1."""
    import torch.distributed as dist
    from _zero3_workers import build_engine

    import hf_zero3
    from hf_zero3.errors import RankDivergenceError

    os.environ["HF_ZERO3_AGREE_TIMEOUT"] = "3"
    rank = dist.get_rank()
    engine, _ = build_engine(hf_aware=False)
    gen = dict(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf_zero3.lockstep_generate(engine, **gen)  # one call in step, so rank 1 has a last position
        if rank == 0:
            start = time.perf_counter()
            try:
                hf_zero3.lockstep_generate(engine, **gen)
                message = "no error"
            except RankDivergenceError as exc:
                message = str(exc)
            with open(os.path.join(flag_dir, "rank0"), "w") as f:
                f.write(f"{time.perf_counter() - start:.2f}\n{message}")
        elif case == "main_process_only":
            mark("rank 1 in a barrier (accelerator.wait_for_everyone())")
        else:  # lockstep applied on rank 0 only: rank 1 generates with transformers alone
            mark("rank 1 in raw generate")
            engine.module.generate(**gen)
    dist.barrier()


@pytest.mark.parametrize("case", ["main_process_only", "lockstep_on_one_rank"])
def test_a_rank_that_never_arrives_is_named_after_the_agreement_timeout(tmp_path, case):
    try:
        run_ranks(_missing_rank, 2, args=(str(tmp_path), case), timeout=90, pg_timeout=10)
    except DistributedFailure as exc:
        # lockstep on one rank: rank 1 runs no hf_zero3 code and waits in DeepSpeed's all-gather
        assert case == "lockstep_on_one_rank" and exc.reports[1].outcome in ("error", "died", "hang"), exc
    seconds, message = open(tmp_path / "rank0").read().split("\n", 1)
    assert 2.5 < float(seconds) < 8, seconds
    assert "rank 1 last agreed in 'generate.end'" in message and "HF_ZERO3_AGREE_TIMEOUT" in message


def _two_threads():
    """Two threads of each rank generate on one model at once: each rank runs them one after the
    other, so the calls pair up in order instead of interleaving their collectives."""
    import threading

    from _zero3_workers import build_engine
    from transformers import LogitsProcessor, LogitsProcessorList

    import hf_zero3

    engine, ref = build_engine(hf_aware=False)
    hf_zero3.lockstep(engine)
    inside, release = threading.Event(), threading.Event()

    class Pause(LogitsProcessor):
        def __call__(self, input_ids, scores):
            inside.set()
            release.wait(30)
            return scores

    gen = dict(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    result, order = {}, []

    def call(name, **kw):
        with torch.no_grad():
            result[name] = engine.module.generate(**gen, **kw)
        order.append(name)

    first = threading.Thread(target=call, args=("first",), kwargs=dict(logits_processor=LogitsProcessorList([Pause()])))
    first.start()
    inside.wait(30)
    second = threading.Thread(target=call, args=("second",))
    second.start()  # queues behind the first call
    time.sleep(0.5)
    waiting = "second" not in result
    release.set()
    first.join(60)
    second.join(60)
    with torch.no_grad():
        exp = ref.generate(**gen, do_sample=False).tolist()
    return dict(waiting=waiting, order=order, ok=[result[n].tolist() == exp for n in ("first", "second")])


def test_a_second_thread_queues_behind_the_first():
    for r in run_ranks(_two_threads, 2, timeout=120, pg_timeout=20):
        assert r["waiting"] and r["order"] == ["first", "second"] and r["ok"] == [True, True], r


# -- finding 4: state never leaks on exceptions -------------------------------------------------


def _exceptions_release_state():
    import torch.distributed as dist
    from _zero3_workers import build_engine
    from transformers import LogitsProcessor, LogitsProcessorList

    import hf_zero3
    from hf_zero3.errors import RankFailure
    from hf_zero3.gathering import gathered_forwards

    rank = dist.get_rank()
    engine, ref = build_engine(hf_aware=False)
    model = engine.module
    ids = torch.tensor([[5, 6, 7, 8]])

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    def partitioned():
        return all(p.numel() == 0 for p in model.parameters())

    out = {"hooks_before": hooks()}
    mlp = model.model.layers[1].mlp

    def boom(*a, **k):
        raise RuntimeError("boom in layer 1")

    mark("layer-wise region, a forward raises")
    mlp.forward = boom
    try:
        with torch.no_grad(), gathered_forwards(engine, "layerwise", layer_hooks="hf_zero3"):
            model(ids)
    except RuntimeError as exc:
        out["layerwise_error"] = str(exc)
    del mlp.forward
    out["layerwise_partitioned"], out["layerwise_hooks"] = partitioned(), hooks()
    with torch.no_grad(), gathered_forwards(engine, "layerwise", layer_hooks="hf_zero3"):
        logits = model(ids).logits
    out["layerwise_after_ok"] = torch.allclose(logits, ref(ids).logits, atol=1e-5)

    mark("gather-all generate, rank 1 raises at its 3rd step")

    class Fail(LogitsProcessor):
        def __init__(self):
            self.n = 0

        def __call__(self, input_ids, scores):
            self.n += 1
            if rank == 1 and self.n == 3:
                raise RuntimeError("logits processor failed on rank 1")
            return scores

    start = time.perf_counter()
    try:
        with torch.no_grad():
            hf_zero3.lockstep_generate(
                engine,
                input_ids=ids,
                max_new_tokens=8,
                pad_token_id=0,
                eos_token_id=None,
                gather="all",
                logits_processor=LogitsProcessorList([Fail()]),
            )
    except RankFailure as exc:
        out["midcall_error"], out["midcall_seconds"] = str(exc), time.perf_counter() - start
    out["midcall_partitioned"], out["midcall_hooks"] = partitioned(), hooks()
    return out


def test_exceptions_leave_parameters_partitioned_and_hooks_restored():
    for r in run_ranks(_exceptions_release_state, 2, timeout=150, pg_timeout=20):
        assert "boom in layer 1" in r["layerwise_error"]
        assert r["layerwise_partitioned"] and r["layerwise_hooks"] == r["hooks_before"]
        assert r["layerwise_after_ok"]
        assert "rank 1 " in r["midcall_error"] and "logits processor failed" in r["midcall_error"]
        assert r["midcall_seconds"] < FAST
        assert r["midcall_partitioned"] and r["midcall_hooks"] == r["hooks_before"]


def _failed_evaluate(tmpdir):
    import torch.distributed as dist
    from fixtures.trainer_job import make_trainer

    from hf_zero3 import Zero3Safe
    from hf_zero3.errors import RankFailure
    from hf_zero3.gathering import active_plan

    rank = dist.get_rank()
    trainer = make_trainer(f"{tmpdir}/ev", callbacks=[Zero3Safe()], max_steps=2)
    trainer.train()
    model = trainer.model

    def metrics(pred):
        if rank == 1:
            raise KeyError("metric only rank 1 lacks")
        return {"m": 1.0}

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hooks()
    trainer.compute_metrics = metrics
    mark("evaluate with a metric failing on rank 1")
    try:
        trainer.evaluate()
        error = None
    except RankFailure as exc:
        error = str(exc)
    state = dict(
        error=error,
        region_open=active_plan(model) is not None,
        hooks_same=hooks() == before,
        partitioned=all(p.numel() == 0 for p in model.parameters()),
    )
    trainer.compute_metrics = None
    state["eval_loss_after"] = trainer.evaluate()["eval_loss"]
    return state


def test_failed_evaluate_releases_its_region_on_every_rank(tmp_path):
    res = run_ranks(_failed_evaluate, 2, args=(str(tmp_path),), init="deepspeed", timeout=200, pg_timeout=30)
    for r in res:
        assert r["error"] and "rank 1 " in r["error"] and "KeyError" in r["error"]
        assert not r["region_open"] and r["partitioned"] and r["hooks_same"]
    assert res[0]["eval_loss_after"] == pytest.approx(res[1]["eval_loss_after"])


# -- a world destroyed and joined again ----------------------------------------------------------


def _worlds_in_turn(tmp: str):
    import datetime
    import gc
    import weakref

    import torch.distributed as dist

    from hf_zero3 import agree

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agreed, mirrors = [], []
    for turn in range(3):
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/world{turn}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
        agreed.append(agree.agree(agree.Tag("turn", counter=turn), None, [10 * turn + rank]))
        mirror = agree.host_group(None)
        mirrors.append((weakref.ref(mirror), dist.get_process_group_ranks(mirror)))
        del mirror
        dist.destroy_process_group()
        gc.collect()
    return dict(agreed=agreed, mirror_ranks=[m[1] for m in mirrors], alive=[m[0]() is not None for m in mirrors])


def test_a_new_world_agrees_over_new_mirrors_and_lets_the_old_ones_go(tmp_path):
    for r in run_ranks(_worlds_in_turn, 2, args=(str(tmp_path),), init="none", timeout=90, pg_timeout=20):
        assert r["agreed"] == [[1], [11], [21]], r  # each world's own maximum
        assert r["mirror_ranks"] == [[0, 1]] * 3, r
        # each world's gloo mirror is let go once the next world starts; the last one stays
        # cached (nothing has asked for a new world since)
        assert r["alive"] == [False, False, True], r
