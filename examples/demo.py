"""hf_zero3 demo: 2 CPU processes (gloo), a tiny Llama under strict DeepSpeed ZeRO-3.

Trains with transformers.Trainer + Zero3Safe, evaluates, then each rank generates from its own
prompts whose EOS comes at very different steps: with lockstep generation every rank runs the same
number of decode forwards and nobody deadlocks. Run with `make demo`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))

from hf_zero3.testing import run_ranks  # noqa: E402


def counting_rows(n: int, seed: int, seq_len: int = 8) -> list[dict]:
    """Causal-LM rows that count upward from a random start: a pattern a tiny model learns."""
    import torch

    starts = torch.randint(3, 96 - seq_len, (n,), generator=torch.Generator().manual_seed(seed))
    rows = [torch.arange(s, s + seq_len) for s in starts.tolist()]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def eos_prompts(reference, steps: int):
    """A token to stop at and prompts for it, from greedy decoding on the unsharded reference (so
    every rank agrees): the ``early`` prompts reach it within 5 steps, the ``late`` ones never
    within ``steps``."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (4,), generator=g).tolist() for _ in range(48)]
    with torch.no_grad():
        runs = [
            reference.generate(
                torch.tensor([p]),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, 4:].tolist()
            for p in prompts
        ]
    for token in dict.fromkeys(t for run in runs for t in run[1:5] if t >= 3):  # not pad, bos or eos
        early = [p for p, run in zip(prompts, runs) if token in run[:5]]
        late = [p for p, run in zip(prompts, runs) if token not in run]
        if late:
            return token, early, late
    raise RuntimeError("no token ends some prompts early and others never")


def rank_job(tmpdir):
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_zero3 import Zero3Safe
    from hf_zero3.testing import tiny_llama_config, trainer_zero3_config, unsharded_copy

    rank = dist.get_rank()
    args = TrainingArguments(
        output_dir=tmpdir,
        use_cpu=True,
        deepspeed=trainer_zero3_config(),  # strict ZeRO-3: nothing stays gathered between uses
        per_device_train_batch_size=2,
        per_device_eval_batch_size=1,
        max_steps=12,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=rank != 0,
        dataloader_num_workers=0,
    )
    # built after TrainingArguments: its DeepSpeed config makes transformers partition the model as
    # it is created (deepspeed.zero.Init), as from_pretrained would
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(tiny_llama_config())
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=counting_rows(32, seed=1),
        eval_dataset=counting_rows(5, seed=2),
        callbacks=[Zero3Safe(sync_every=4)],
    )
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    eval_loss = trainer.evaluate()["eval_loss"]
    model = trainer.model
    steps = 24
    eos, early, late = eos_prompts(unsharded_copy(model), steps)
    # (every rank must still call generate() the same number of times)
    # first call: rank 0 finishes early, rank 1 runs to the budget; second call: both finish early
    prompts = [early[0] if rank == 0 else late[0], early[min(rank, len(early) - 1)]]
    lengths, forwards = [], []
    model.eval()
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
            )
        lengths.append(out.shape[1] - len(p))
        forwards.append(model.hf_zero3_last_generate.forwards)
    return dict(
        rank=rank,
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        eval_loss=eval_loss,
        train_s=train_s,
        lengths=lengths,
        forwards=forwards,
        steps=steps,
        gather=model.hf_zero3_last_generate.gather,
        plan=model.hf_zero3_last_eval_plan.strategy,
    )


def main():
    start = time.time()
    print("hf_zero3 demo: 2 ranks (gloo, CPU), tiny Llama, strict ZeRO-3, Trainer + Zero3Safe", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(rank_job, 2, args=(tmp,), init="deepspeed", timeout=170, pg_timeout=60, capture=False)
    r0 = results[0]
    print("\n==================== report ====================")
    losses = r0["losses"]
    print(f"train loss ({len(losses)} steps): " + " ".join(f"{x:.3f}" for x in losses))
    print(f"eval loss: {r0['eval_loss']:.4f}  (eval forwards used gather strategy '{r0['plan']}')")
    print(f"lockstep generation (max_new_tokens={r0['steps']}, stop='sync', sync_every=4):")
    for r in results:
        for i, (n, f) in enumerate(zip(r["lengths"], r["forwards"])):
            print(
                f"  rank {r['rank']} prompt {i}: generated {n:2d} tokens, "
                f"{f:2d} decode forwards (gather: {r['gather']})"
            )
    same = all(
        results[0]["forwards"][i] == results[1]["forwards"][i]
        for i in range(min(len(results[0]["forwards"]), len(results[1]["forwards"])))
    )
    print(f"same number of forwards on both ranks for each call: {same}")
    print(f"total wall time: {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
