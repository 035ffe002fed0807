"""Zero3Safe inside transformers.Trainer under strict ZeRO-3 on 2 gloo ranks (no DeepCompile on
CPU): train, evaluate, predict and predict-with-generate, checked against a single-process
reference computed from the same gathered weights."""

import pytest
import torch

from hf_zero3.testing import mark, run_ranks


def _trainer_run(tmpdir):
    from fixtures.trainer_job import make_trainer, train_losses

    from hf_zero3 import Zero3Safe
    from hf_zero3.gathering import active_plan
    from hf_zero3.testing import models

    out = {}
    # 1) train -> train (no eval) and train -> eval -> train: same losses
    mark("trainer without eval")
    t_plain = make_trainer(f"{tmpdir}/a", callbacks=[Zero3Safe()], max_steps=4)
    t_plain.train()
    out["losses_plain"] = train_losses(t_plain)
    del t_plain
    mark("trainer with eval every 2 steps")
    trainer = make_trainer(f"{tmpdir}/b", callbacks=[Zero3Safe()], max_steps=4, eval_steps=2)
    trainer.train()
    out["losses_with_eval"] = train_losses(trainer)
    model = trainer.model
    out["eval_plan"] = getattr(model, "hf_zero3_last_eval_plan", None)
    out["region_open_after_train"] = active_plan(model) is not None

    # 2) evaluate / predict vs the single-process reference on the trained weights
    mark("evaluate")
    metrics = trainer.evaluate()
    out["eval_loss"] = metrics["eval_loss"]
    out["region_open_after_eval"] = active_plan(model) is not None
    out["params_partitioned"] = all(p.numel() == 0 for p in model.parameters())
    mark("predict")
    pred = trainer.predict(trainer.eval_dataset)
    out["pred_logits"] = torch.as_tensor(pred.predictions).float()
    mark("reference")
    ref = models.unsharded_copy(model)
    losses, logits = [], []
    with torch.no_grad():
        for row in trainer.eval_dataset:
            o = ref(input_ids=row["input_ids"][None], labels=row["labels"][None])
            losses.append(o.loss.item())
            logits.append(o.logits[0])
    out["ref_eval_loss"] = sum(losses) / len(losses)
    out["ref_logits"] = torch.stack(logits)
    return out


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    return run_ranks(_trainer_run, 2, args=(str(tmp),), init="deepspeed", timeout=300, pg_timeout=30)


def test_eval_between_steps_leaves_training_unchanged(trainer_results):
    for r in trainer_results:
        assert len(r["losses_plain"]) == 4
        assert r["losses_with_eval"] == pytest.approx(r["losses_plain"], rel=1e-5, abs=1e-6)


def test_eval_region_gathered_all_and_was_released(trainer_results):
    for r in trainer_results:
        assert r["eval_plan"] is not None and r["eval_plan"].strategy == "all"
        assert not r["region_open_after_train"]
        assert not r["region_open_after_eval"]
        assert r["params_partitioned"]


def test_evaluate_matches_single_process_reference(trainer_results):
    for r in trainer_results:
        assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=1e-4)


def test_predict_logits_match_reference_uneven_eval_set(trainer_results):
    for r in trainer_results:
        # 5 eval rows on 2 ranks: accelerate pads the last batch and drops the duplicate again
        assert r["pred_logits"].shape == r["ref_logits"].shape
        torch.testing.assert_close(r["pred_logits"], r["ref_logits"], rtol=1e-4, atol=1e-4)


def _seq2seq_generate(tmpdir):
    from fixtures.trainer_job import make_trainer

    from hf_zero3 import Zero3Safe
    from hf_zero3.testing import models

    trainer = make_trainer(f"{tmpdir}/s2s", callbacks=[Zero3Safe(sync_every=2)], max_steps=2, seq2seq=True, n_eval=3)
    trainer.train()

    # uneven prompt lengths per rank: each rank's shard of a dataset of different-length rows
    class Prompts(torch.utils.data.Dataset):
        def __init__(self):
            self.rows = [torch.arange(10, 10 + n) for n in (3, 6, 4, 7)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}

    mark("predict_with_generate")
    pred = trainer.predict(Prompts(), max_new_tokens=5)
    model = trainer.model
    stats = model.hf_zero3_last_generate
    ref = models.unsharded_copy(model)
    exp = []
    with torch.no_grad():
        for row in Prompts():
            g = ref.generate(input_ids=row["input_ids"][None], max_new_tokens=5, do_sample=False, pad_token_id=0)
            exp.append(g[0].tolist())
    return dict(pred=pred.predictions.tolist(), exp=exp, stats=stats)


def test_predict_with_generate_uneven_prompts_matches_reference(tmp_path):
    res = run_ranks(_seq2seq_generate, 2, args=(str(tmp_path),), init="deepspeed", timeout=240, pg_timeout=30)
    for r in res:
        assert r["stats"] is not None and r["stats"].forwards == 5
        for got, exp in zip(r["pred"], r["exp"]):
            # predictions are padded to a common length with -100 / pad; compare the prefix
            got = [t for t in got if t not in (-100,)][: len(exp)]
            assert got == exp


def _zero2_with_a_bogus_plan_variable(tmpdir):
    """Zero3Safe is harmless without ZeRO-3, even with a bad HF_ZERO3_* setting it never needs."""
    import os

    from fixtures.trainer_job import make_trainer, train_losses

    from hf_zero3 import Zero3Safe
    from hf_zero3._upstream import patches

    os.environ["HF_ZERO3_MODE"] = "bogus"
    trainer = make_trainer(
        f"{tmpdir}/z2", callbacks=[Zero3Safe()], max_steps=2, eval_steps=1, ds_extra={"zero_optimization": {"stage": 2}}
    )
    trainer.train()
    return dict(losses=train_losses(trainer), patches=patches.installed())


def test_zero3safe_is_harmless_under_zero2(tmp_path):
    for r in run_ranks(
        _zero2_with_a_bogus_plan_variable, 2, args=(str(tmp_path),), init="deepspeed", timeout=200, pg_timeout=30
    ):
        assert len(r["losses"]) == 2 and r["patches"] == []


def _classifier_without_generate(tmpdir):
    """A BERT classifier (no generate()) under ZeRO-3: Zero3Safe still protects its eval forwards,
    and the Trainer's metrics are those of the same run without it."""
    import logging

    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hf_zero3 import Zero3Safe
    from hf_zero3.testing.configs import trainer_zero3_config

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_zero3.trainer").addHandler(handler)
    logging.getLogger("hf_zero3.trainer").setLevel(logging.INFO)

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.rows = [(torch.randint(3, 96, (8,), generator=g), int(i % 2)) for i in range(n)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i][0], "labels": torch.tensor(self.rows[i][1])}

    def run(callbacks):
        args = TrainingArguments(
            output_dir=f"{tmpdir}/bert",
            use_cpu=True,
            deepspeed=trainer_zero3_config(),
            per_device_train_batch_size=2,
            per_device_eval_batch_size=1,
            max_steps=2,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        cfg = BertConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=2,
        )
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg)  # built under the live ZeRO-3 config: partitioned
        trainer = Trainer(
            model=model, args=args, train_dataset=Rows(8, 1), eval_dataset=Rows(4, 2), callbacks=callbacks
        )
        trainer.train()
        return trainer

    plain = run([]).evaluate()["eval_loss"]
    trainer = run([Zero3Safe()])
    loss = trainer.evaluate()["eval_loss"]
    plan = trainer.model.hf_zero3_last_eval_plan
    return dict(
        loss=loss,
        plain_loss=plain,
        plan=plan.strategy,
        partitioned=all(p.numel() == 0 for p in trainer.model.parameters()),
        said=[r.getMessage() for r in records if "has no generate()" in r.getMessage()],
    )


def test_zero3safe_protects_a_model_without_generate(tmp_path):
    for r in run_ranks(
        _classifier_without_generate, 2, args=(str(tmp_path),), init="deepspeed", timeout=200, pg_timeout=30
    ):
        assert r["plan"] == "all" and r["partitioned"]
        assert r["loss"] == pytest.approx(r["plain_loss"], rel=1e-5)
        assert r["said"] and "BertForSequenceClassification" in r["said"][0]
