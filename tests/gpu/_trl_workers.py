"""Rank-side code for the TRL GPU tests: TRL's GRPO with ``Zero3Safe()`` and TRL's default
arguments apart from sizes, on a small Qwen2 (bf16, SDPA) under ZeRO-3, with or without DeepCompile."""

from __future__ import annotations

import math

import torch


def grpo_rollouts(tmpdir: str, deepcompile: bool, script: str | None = None) -> dict:
    """Train 4 GRPO steps, evaluating after steps 2 and 4; what each rollout's decoding did."""
    from fixtures import trl_jobs
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import mark, tiny_tokenizer, trainer_zero3_config

    tok = tiny_tokenizer()
    ds = trainer_zero3_config()
    if deepcompile:
        ds["compile"] = {"deepcompile": True}
    args = GRPOConfig(
        output_dir=tmpdir,
        bf16=True,
        deepspeed=ds,
        torch_compile=deepcompile,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=8,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    model = trl_jobs._model(
        tok,
        script=script,
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    graphs = trl_jobs.GraphCount()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_jobs.length_reward,
        args=args,
        train_dataset=trl_jobs.chat_prompts(),
        eval_dataset=trl_jobs.chat_prompts(8),
        processing_class=tok,
        callbacks=[hf_zero3.Zero3Safe(), graphs],
    )
    # Each Dynamo reset (DeepCompile's, at a launch of its passes) and the Dynamo graphs the
    # rollouts finished before it had compiled: what a reset there would throw away.
    resets = []
    reset = torch._dynamo.reset

    def reset_spy():
        last = hf_zero3.runtime_of(trainer.model).generation.last
        resets.append(last.compiles if last is not None else 0)
        reset()

    torch._dynamo.reset = reset_spy
    mark(f"GRPO deepcompile={deepcompile} script={script}")
    try:
        trainer.train()
    finally:
        torch._dynamo.reset = reset
    res = trl_jobs._result(trainer)
    last = hf_zero3.runtime_of(trainer.model).generation.last
    evals = [v for h in res["logs"] for k, v in h.items() if k.startswith("eval_") and isinstance(v, float)]
    return dict(
        loops=res["loops"],
        graphs=graphs.counts,
        losses=res["losses"],
        evals=evals,
        eval_logs=sum(1 for h in res["logs"] if any(k.startswith("eval_") for k in h)),
        decode=last.decode,
        decode_reason=last.decode_reason,
        prefill=last.prefill,
        step=last.step,
        graph_steps=last.graph_steps,
        prefill_reason=last.prefill_reason,
        sync_every=last.sync_every,
        late_checks=last.late_checks,
        finite=all(math.isfinite(x) for x in res["losses"] + evals),
        resets=resets,
    )
