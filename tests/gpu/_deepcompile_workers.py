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


def llama_cfg():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build(deepcompile: bool = True, compile_: bool = True, torch_adam: bool = False):
    import deepspeed
    import torch.distributed as dist

    from hf_zero3.testing import models

    ds = dc_config(dist.get_world_size(), deepcompile)
    if torch_adam:
        ds["optimizer"]["params"]["torch_adam"] = True
    model = models.zero3_model(llama_cfg(), ds, seed=0, dtype=torch.bfloat16)
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


def trainer_deepcompile(tmpdir: str, with_zero3safe: bool, evaluate_first: bool = False):
    """TrainingArguments(torch_compile=True, eval_steps=3) with DeepCompile ZeRO-3; with
    ``evaluate_first`` the script takes a baseline ``evaluate()`` before ``train()`` and saves the
    model after it (``save_model``)."""
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    import hf_zero3
    from hf_zero3 import Zero3Safe
    from hf_zero3.testing import mark, models

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.rows = [torch.randint(3, 32000, (SEQ,), generator=g) for _ in range(n)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    ds = dc_config(dist.get_world_size())
    ds.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
    ds["optimizer"]["params"]["lr"] = "auto"
    args = TrainingArguments(
        output_dir=tmpdir,
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
    cls = models.model_class_for(llama_cfg())
    torch.manual_seed(0)
    model = cls._from_config(llama_cfg(), dtype=torch.bfloat16)
    cbs = [Zero3Safe()] if with_zero3safe else []
    trainer = Trainer(model=model, args=args, train_dataset=Rows(32, 1), eval_dataset=Rows(6, 2), callbacks=cbs)
    out = {}
    if evaluate_first:
        mark("trainer.evaluate before train")
        out["baseline"] = trainer.evaluate()["eval_loss"]
    mark("trainer.train with eval every 3 steps")
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    planner = hf_zero3.runtime_of(trainer.model_wrapped).memory_plan
    out.update(evals=evals, losses=losses, plan=planner.summary() if planner else None)
    engine = trainer.model_wrapped
    out["optimizer_from_config"] = getattr(engine, "client_optimizer", "missing") is None
    if evaluate_first:
        mark("trainer.save_model")
        trainer.save_model(f"{tmpdir}/saved")
        import os

        out["saved"] = sorted(os.listdir(f"{tmpdir}/saved"))
    return out
