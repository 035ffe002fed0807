"""A Trainer's life cycle beyond one train(), under strict ZeRO-3 on 2 gloo ranks with DeepSpeed's
AdamW from the config: ``evaluate()``, ``predict()`` or ``generate()`` before ``train()`` with
``Zero3Safe`` trains with the config's optimizer and the losses of a run that never evaluated first
(without it, transformers' freed inference engine makes the first step fail: the control);
``train()`` twice, and a run resumed from its checkpoint, train and evaluate."""

import pytest

from hf_zero3.testing import mark, run_ranks


def _train_facts(trainer) -> dict:
    from fixtures.trainer_job import train_losses

    engine = trainer.model_wrapped
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return dict(
        losses=train_losses(trainer),
        engine_is_accelerates=engine is trainer.accelerator.deepspeed_engine_wrapped.engine,
        # DeepSpeed built the optimizer from its config (no optimizer handed to initialize)
        optimizer_from_config=getattr(engine, "client_optimizer", "missing") is None,
        optimizer=type(getattr(engine.optimizer, "optimizer", None)).__name__,
        param_groups=len(engine.optimizer.optimizer.param_groups),
        config_optimizer=config.get("optimizer", {}).get("type"),
    )


def _first_eval_run(tmpdir, first: str, safe: bool):
    import torch
    from fixtures.trainer_job import make_trainer

    from hf_zero3 import Zero3Safe

    mark(f"{first} before train (Zero3Safe: {safe})")
    trainer = make_trainer(f"{tmpdir}/{first}{safe}", callbacks=[Zero3Safe()] if safe else [], max_steps=6)
    out = {}
    if first == "evaluate":
        out["first"] = trainer.evaluate()["eval_loss"]
    elif first == "predict":
        out["first"] = float(torch.as_tensor(trainer.predict(trainer.eval_dataset).predictions).float().abs().sum())
    elif first == "generate":
        ids = trainer.eval_dataset[0]["input_ids"][None, :4]
        out["first"] = trainer.model.generate(ids, max_new_tokens=3, do_sample=False).shape[1]
    mark(f"train after {first}")
    if not safe:
        try:
            trainer.train()
        except AttributeError as exc:  # every rank fails the same way, before any collective
            return {"error": str(exc)}
        return {"error": None}
    trainer.train()
    out.update(_train_facts(trainer))
    mark("evaluate after train")
    out["after"] = trainer.evaluate()["eval_loss"]
    return out


def _plain_run(tmpdir):
    from fixtures.trainer_job import make_trainer

    from hf_zero3 import Zero3Safe

    trainer = make_trainer(f"{tmpdir}/plain", callbacks=[Zero3Safe()], max_steps=6)
    trainer.train()
    return _train_facts(trainer)


def _run(tmp_path_factory, *args):
    tmp = tmp_path_factory.mktemp("first_eval")
    return run_ranks(_first_eval_run, 2, args=(str(tmp), *args), init="deepspeed", timeout=240, pg_timeout=30)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return run_ranks(_plain_run, 2, args=(str(tmp),), init="deepspeed", timeout=240, pg_timeout=30)


@pytest.mark.parametrize("first", ["evaluate", "predict", "generate"])
def test_a_call_before_train_trains_with_the_configs_optimizer(tmp_path_factory, plain, first):
    results = _run(tmp_path_factory, first, True)
    for rank, (got, ref) in enumerate(zip(results, plain)):
        assert got["engine_is_accelerates"] and got["optimizer_from_config"], (rank, got)
        assert got["config_optimizer"] == "AdamW" and got["optimizer"] == ref["optimizer"] == "AdamW"
        assert got["param_groups"] == ref["param_groups"]
        assert len(got["losses"]) == 6 and got["losses"][-1] < got["losses"][0]
        # the same training as a run that never evaluated first: the user's optimizer and schedule
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), rank
        assert got["after"] == got["after"]  # finite evaluation after training (not NaN)
    assert results[0]["first"] == results[1]["first"]


def test_without_zero3safe_the_first_step_after_an_evaluation_fails(tmp_path_factory):
    """The control: transformers' Trainer alone keeps a freed inference engine."""
    results = _run(tmp_path_factory, "evaluate", False)
    for got in results:
        assert got["error"] is not None and "backward" in got["error"], got


def _again_and_resume(tmpdir):
    import math

    from fixtures.trainer_job import make_trainer, train_losses

    from hf_zero3 import Zero3Safe

    out = {}
    mark("train twice")
    trainer = make_trainer(f"{tmpdir}/twice", callbacks=[Zero3Safe()], max_steps=3)
    trainer.train()
    first = train_losses(trainer)
    trainer.train()  # a new engine over the same partitioned model, the config's optimizer again
    out["twice"] = (first, train_losses(trainer), _train_facts(trainer)["optimizer_from_config"])
    out["twice_eval"] = math.isfinite(trainer.evaluate()["eval_loss"])
    mark("train with checkpoints")
    full = make_trainer(f"{tmpdir}/full", callbacks=[Zero3Safe()], max_steps=4)
    full.args.save_strategy, full.args.save_steps = "steps", 2
    full.train()
    out["full"] = train_losses(full)
    mark("resume from step 2")
    resumed = make_trainer(f"{tmpdir}/resumed", callbacks=[Zero3Safe()], max_steps=4)
    resumed.train(resume_from_checkpoint=f"{tmpdir}/full/checkpoint-2")
    out["resumed"] = train_losses(resumed)
    out["resumed_eval"] = math.isfinite(resumed.evaluate()["eval_loss"])
    return out


def test_train_twice_and_resume_from_a_checkpoint(tmp_path):
    results = run_ranks(_again_and_resume, 2, args=(str(tmp_path),), init="deepspeed", timeout=300, pg_timeout=30)
    for got in results:
        first, second, from_config = got["twice"]
        assert len(first) == 3 and len(second) == 3 and from_config
        assert got["twice_eval"] and got["resumed_eval"]
        # the resumed run trains steps 3-4 as the run it resumes did (same weights, optimizer state, data)
        # (its log history comes back from the checkpoint: steps 1-2 as saved, then 3-4 trained)
        assert len(got["full"]) == 4 and len(got["resumed"]) == 4, got
        assert got["resumed"] == pytest.approx(got["full"], rel=1e-4, abs=1e-5), got
