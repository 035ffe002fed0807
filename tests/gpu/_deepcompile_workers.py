"""Rank-side code for the DeepCompile GPU tests and the eval benchmark (NCCL, one GPU a rank).

The model is the issue's reproduction: a Llama with 4 layers, hidden 1024, GQA 16/8, vocab 32000,
SDPA attention, bf16, ZeRO-3 with ``"compile": {"deepcompile": true}`` and ``engine.compile()``.
"""

from __future__ import annotations

import time

import torch

SEQ = 128


def dc_config(world_size: int, deepcompile: bool = True) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    if deepcompile:
        cfg["compile"] = {"deepcompile": True}
    return cfg


def build(deepcompile: bool = True, compile_: bool = True, torch_adam: bool = False, config=None):
    """``config``: another model config than the Llama's (the same sizes)."""
    import deepspeed
    import torch.distributed as dist

    from hf_zero3.testing import models

    ds = dc_config(dist.get_world_size(), deepcompile)
    if torch_adam:
        ds["optimizer"]["params"]["torch_adam"] = True
    model = models.zero3_model(config or models.small_llama_config(), ds, seed=0, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    if compile_:
        engine.compile()
    return engine


def batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, 32000, (2, SEQ), generator=g).to(device)
    return ids


def train_steps(engine, steps, start=0):
    import torch.distributed as dist

    losses, times = [], []
    engine.train()
    for s in range(start, start + steps):
        ids = batch(s, dist.get_rank(), engine.device)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return losses, times


def eval_ids(engine):
    import torch.distributed as dist

    return batch(10_000, dist.get_rank(), engine.device)


def raw_eval_then_train():
    """The bug: an eval forward after engine.compile(), then one more training step."""
    from hf_zero3.testing import mark

    engine = build()
    train_steps(engine, 3)
    engine.eval()
    errors = {}
    for name, call in (
        ("engine", lambda ids: engine(input_ids=ids)),
        ("module", lambda ids: engine.module(input_ids=ids)),
        ("dynamo_disable", torch._dynamo.disable(lambda ids: engine.module(input_ids=ids))),
    ):
        mark(f"raw eval through {name}")
        try:
            with torch.no_grad():
                call(eval_ids(engine))
            errors[name] = None
        except Exception as e:  # the failure we reproduce
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    mark("training step after the failed eval")
    try:
        train_steps(engine, 1, start=3)
        errors["train_after"] = None
    except Exception as e:
        errors["train_after"] = f"{type(e).__name__}: {str(e)[:300]}"
    return errors


def protected_eval(eval_first: bool = True, gather: str = "auto"):
    """train 7 -> [eval under hf_zero3] -> train 4; logits vs an eager copy of the same weights."""
    import hf_zero3
    from hf_zero3._upstream.torch import dynamo_graph_count
    from hf_zero3.testing import mark, models

    engine = build()
    out = {}
    mark("train 7 steps")
    l1, t1 = train_steps(engine, 7)
    graphs_before = dynamo_graph_count()
    if eval_first:
        engine.eval()
        ids = eval_ids(engine)
        mark("eval through engine / module / dynamo-disabled frame")
        with torch.no_grad():
            torch.cuda.synchronize()
            t = time.perf_counter()
            with hf_zero3.eval_forward(engine, gather=gather) as plan:
                logits = engine(input_ids=ids, labels=ids)
                via_module = engine.module(input_ids=ids).logits
                via_disabled = torch._dynamo.disable(lambda: engine.module(input_ids=ids))().logits
            torch.cuda.synchronize()
            out["eval_s"] = time.perf_counter() - t
            out["plan"] = plan.strategy
            # the bare calls of the issue, each protected on its own by EvalGatherMixin
            hf_zero3.lockstep(engine)
            bare = engine.module(input_ids=ids).logits
        out["eval_loss"] = logits.loss.item()
        ref = models.unsharded_copy(engine.module).to(engine.device, torch.bfloat16)
        with torch.no_grad():
            r = ref(input_ids=ids, labels=ids)
        out["ref_loss"] = r.loss.item()
        out["max_logit_diff"] = (logits.logits.float() - r.logits.float()).abs().max().item()
        out["module_vs_engine"] = (via_module.float() - logits.logits.float()).abs().max().item()
        out["disabled_vs_engine"] = (via_disabled.float() - logits.logits.float()).abs().max().item()
        out["bare_vs_engine"] = (bare.float() - logits.logits.float()).abs().max().item()
        del ref
    mark("train 4 more steps")
    l2, t2 = train_steps(engine, 4, start=7)
    out["graphs_added_after_eval"] = dynamo_graph_count() - graphs_before
    out["losses"] = l1 + l2
    out["step_s_before"] = sorted(t1[5:7])[0:2]
    out["step_s_after"] = sorted(t2[1:4])
    return out


class _Rows(torch.utils.data.Dataset):
    """``n`` random token rows of length SEQ (labels: the rows), fixed by ``seed``."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(3, 32000, (SEQ,), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _dc_trainer(output_dir: str, **overrides):
    """A Trainer with ``Zero3Safe()`` over the 4-layer Llama, DeepCompile ZeRO-3 (torch_compile=True),
    the config's optimizer and ``"auto"`` sizes; ``overrides``: TrainingArguments fields."""
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from hf_zero3 import Zero3Safe
    from hf_zero3.testing import models

    ds = dc_config(dist.get_world_size())
    ds.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
    ds["optimizer"]["params"]["lr"] = "auto"
    fields = dict(
        output_dir=output_dir,
        torch_compile=True,
        bf16=True,
        eval_strategy="steps",
        eval_steps=3,
        max_steps=7,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        deepspeed=ds,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    fields.update(overrides)
    cfg = models.small_llama_config()
    cls = models.model_class_for(cfg)
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=torch.bfloat16)
    return Trainer(
        model=model,
        args=TrainingArguments(**fields),
        train_dataset=_Rows(32, 1),
        eval_dataset=_Rows(6, 2),
        callbacks=[Zero3Safe()],
    )


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainer_deepcompile(tmpdir: str, evaluate_first: bool = False):
    """TrainingArguments(torch_compile=True, eval_steps=3) with DeepCompile ZeRO-3 and Zero3Safe;
    with ``evaluate_first`` the script takes a baseline ``evaluate()`` before ``train()`` and saves
    the model after it (``save_model``)."""
    import hf_zero3
    from hf_zero3.testing import mark

    trainer = _dc_trainer(tmpdir)
    out = {}
    if evaluate_first:
        mark("trainer.evaluate before train")
        out["baseline"] = trainer.evaluate()["eval_loss"]
    mark("trainer.train with eval every 3 steps")
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    planner = hf_zero3.runtime_of(trainer.model_wrapped).memory.plan
    out.update(evals=evals, losses=_losses(trainer), plan=planner.summary() if planner else None)
    engine = trainer.model_wrapped
    out["optimizer_from_config"] = getattr(engine, "client_optimizer", "missing") is None
    if evaluate_first:
        mark("trainer.save_model")
        trainer.save_model(f"{tmpdir}/saved")
        import os

        out["saved"] = sorted(os.listdir(f"{tmpdir}/saved"))
    return out


def trainer_deepcompile_resume(tmpdir: str):
    """Under DeepCompile ZeRO-3 with Zero3Safe: 4 steps saving every 2 (then ``train()`` again on
    the same Trainer), and a new Trainer resumed from the step-2 checkpoint, evaluated after."""
    import os

    from hf_zero3.testing import mark

    args = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no")
    mark("uninterrupted: 4 steps, checkpoints at 2 and 4")
    first = _dc_trainer(f"{tmpdir}/run", **args)
    first.train()
    out = {"uninterrupted": _losses(first), "checkpoints": sorted(os.listdir(f"{tmpdir}/run"))}
    mark("train() again on the same Trainer")
    first.args.max_steps = 6  # six steps on the trained model, from a fresh engine
    first.args.output_dir = f"{tmpdir}/again"  # its checkpoints apart: the resume reads the first run's
    first.train()
    out["again"] = [h["loss"] for h in first.state.log_history if "loss" in h]
    out["again_optimizer_from_config"] = getattr(first.model_wrapped, "client_optimizer", "missing") is None
    del first
    torch.cuda.empty_cache()
    mark("resumed from checkpoint-2")
    resumed = _dc_trainer(f"{tmpdir}/resumed", **args)
    resumed.train(resume_from_checkpoint=f"{tmpdir}/run/checkpoint-2")
    # the log history restored from checkpoint-2 holds steps 1-2; the resumed run logs steps 3-4
    out["resumed"] = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 2]
    out["resumed_step"] = resumed.state.global_step
    mark("evaluate after resuming")
    out["eval_after_resume"] = resumed.evaluate()["eval_loss"]
    return out


def padded_prompts_decode():
    """A DeepCompile engine trained 2 steps, then 64 left-padded prompts of lengths 104-111 through
    the static loop (compiled prompt forward, then the eager one), then 2 more training steps."""
    import torch.distributed as dist

    import hf_zero3
    from hf_zero3.options import DecodeOptions
    from hf_zero3.testing import mark

    engine = build()
    train_steps(engine, 2)
    engine.eval()
    rows, g = 64, torch.Generator().manual_seed(dist.get_rank())
    lens = [104 + (i * 5) % 8 for i in range(rows)]
    width = max(lens)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, width - n :] = torch.randint(3, 32000, (n,), generator=g)
        mask[i, width - n :] = 1
    kw = dict(
        input_ids=ids.to(engine.device),
        attention_mask=mask.to(engine.device),
        gather="all",
        decode="compiled",
        do_sample=False,
        max_new_tokens=16,
        pad_token_id=0,
        eos_token_id=2,
    )
    out = {"rows": rows}
    mark("static loop over padded prompts, compiled prompt forward")
    with torch.no_grad():
        seq = hf_zero3.lockstep_generate(engine, **kw)
        st = hf_zero3.runtime_of(engine.module).generation.last
        out.update(loop=st.loop, decode=st.decode, prefill=st.prefill, prefill_reason=st.prefill_reason)
        mark("static loop over padded prompts, eager prompt forward")
        eager = hf_zero3.lockstep_generate(engine, decode_options=DecodeOptions(compile_prefill=False), **kw)
        out["eager_prefill"] = hf_zero3.runtime_of(engine.module).generation.last.prefill
    out["first_token_agree"] = int((seq[:, width] == eager[:, width]).sum())
    out["sdpa"] = engine.module.config._attn_implementation == "sdpa"
    mark("training after the padded decode")
    out["losses_after"], _ = train_steps(engine, 2, start=2)
    return out
