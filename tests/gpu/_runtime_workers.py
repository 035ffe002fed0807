"""Rank-side code for the runtime / TRL GPU tests (NCCL, one GPU a rank)."""

from __future__ import annotations

import torch
from _deepcompile_workers import build, eval_ids, train_steps


def two_deepcompile_engines():
    """A policy trained and a reference evaluated, both DeepCompile engines of one process, each
    with its own memory plan. The reference's plan is registered second (before #11 its pass took
    the policy's graphs over: DeepCompile's pass table is process-wide) but compiled first: DeepSpeed
    0.19.8 keeps one DeepCompile native state per process, owned by the engine compiled last."""
    import hf_zero3
    from hf_zero3.compile import MemoryPlanConfig
    from hf_zero3.compile.memory_plan import apply_memory_plan
    from hf_zero3.testing import mark, models

    policy = build(compile_=False, torch_adam=True)
    reference = build(compile_=False, torch_adam=True)
    plan_p, schedule_p = apply_memory_plan(policy, MemoryPlanConfig())
    plan_r, schedule_r = apply_memory_plan(reference, MemoryPlanConfig(mode="match_zero3"))
    reference.compile(schedule=schedule_r)
    policy.compile(schedule=schedule_p)
    hf_zero3.lockstep(reference)  # its eval forwards gather eagerly instead of entering its graph
    eager = models.unsharded_copy(reference.module).to(reference.device, torch.bfloat16)
    ids = eval_ids(reference)
    with torch.no_grad():
        expected = eager(input_ids=ids).logits.float()
    del eager
    losses, diffs = [], []
    for step in range(4):
        mark(f"policy step {step}, reference eval")
        losses += train_steps(policy, 1, start=step)[0]
        reference.eval()
        with torch.no_grad():
            diffs.append((reference.module(input_ids=ids).logits.float() - expected).abs().max().item())
    rt_p, rt_r = hf_zero3.runtime_of(policy), hf_zero3.runtime_of(reference)
    return dict(
        losses=losses,
        diffs=diffs,
        policy_plan=plan_p.summary(),
        reference_plan=plan_r.summary(),
        own=(rt_p.memory.plan is plan_p, rt_r.memory.plan is plan_r, rt_p is not rt_r),
    )


def grpo_deepcompile(tmpdir: str, gradient_checkpointing: bool = True):
    """TRL GRPO whose policy engine runs DeepCompile (torch_compile=True, Zero3Safe): it trains,
    generates before every step and evaluates, and the training graphs are compiled once."""
    import logging

    from fixtures.trl_jobs import GraphCount
    from transformers import Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import chat_prompts, length_reward, small_qwen2_config, tiny_tokenizer, trainer_zero3_config

    tok = tiny_tokenizer()
    ds = trainer_zero3_config(extra={"compile": {"deepcompile": True}, "bf16": {"enabled": True}})
    graphs, recompiles = GraphCount(), []

    class Recompiles(logging.Handler):  # Dynamo's reasons, for the failure message
        def emit(self, record):
            recompiles.append(record.getMessage()[:400])

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(Recompiles())

    args = GRPOConfig(
        output_dir=tmpdir,
        bf16=True,
        torch_compile=True,
        deepspeed=ds,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        max_steps=5,
        eval_strategy="steps",
        eval_steps=2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing,
    )
    cfg = small_qwen2_config(vocab_size=len(tok))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=chat_prompts(),
        eval_dataset=chat_prompts(4),
        processing_class=tok,
        callbacks=[hf_zero3.Zero3Safe(), graphs],
    )
    trainer.train()
    logs = trainer.state.log_history
    rt = hf_zero3.runtime_of(trainer.model_wrapped)
    return dict(
        losses=[h["loss"] for h in logs if "loss" in h],
        evals=[h for h in logs if "eval_loss" in h or "eval_reward" in h],
        graphs=graphs.counts,
        recompiles=recompiles[:8],
        deepcompile=rt.deepcompile_active(),
        plan=rt.memory.plan.summary() if rt.memory.plan else None,
        gather=rt.generation.last.gather if rt.generation.last else None,
    )


def grpo_compiled_decode(tmpdir: str, steps: int = 3, cuda: bool = True):
    """TRL's GRPO under plain ZeRO-3 with ``Zero3Safe(decode="compiled")``: every rollout (TRL's
    gathered model, TRL's default sampling) runs hf_zero3's static loop with CUDA graphs and the
    grouped-heads attention; per rollout, whether it replayed the last one's graphs."""
    from transformers import Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import chat_prompts, length_reward, small_qwen2_config, tiny_tokenizer, trainer_zero3_config

    class Rollouts(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            g = hf_zero3.runtime_of(model).generation.last
            self.seen.append(
                dict(
                    loop=g.loop,
                    loop_reason=g.loop_reason,
                    decode=g.decode,
                    reason=g.decode_reason,
                    graph_steps=g.graph_steps,
                    reused=g.graphs_reused,
                    loop_reused=g.loop_reused,
                    attention=g.decode_report.attention,
                    forwards=g.forwards,
                )
            )

    tok = tiny_tokenizer()
    ds = trainer_zero3_config(extra={"bf16": {"enabled": cuda}})
    args = GRPOConfig(
        output_dir=tmpdir,
        bf16=cuda,
        use_cpu=not cuda,
        deepspeed=ds,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        max_steps=steps,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    cfg = small_qwen2_config(vocab_size=len(tok))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    rollouts = Rollouts()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=chat_prompts(),
        processing_class=tok,
        callbacks=[hf_zero3.Zero3Safe(decode="compiled"), rollouts],
    )
    trainer.train()
    return dict(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h], rollouts=rollouts.seen)
