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


def rank_job(tmpdir):
    import torch
    import torch.distributed as dist

    from hf_zero3 import Zero3Safe
    from hf_zero3.testing.models import unsharded_copy
    from hf_zero3.testing.scenarios import find_eos_scenario
    from hf_zero3.testing.trainer_job import make_trainer, train_losses

    rank = dist.get_rank()
    trainer = make_trainer(tmpdir, callbacks=[Zero3Safe(sync_every=4)], max_steps=12, eval_steps=6, progress=rank == 0)
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    eval_loss = trainer.evaluate()["eval_loss"]
    model = trainer.model
    # prompts whose greedy continuations hit EOS early (rank 0) or not at all (rank 1)
    sc = find_eos_scenario(unsharded_copy(model), steps=24, early_by=5)
    # (every rank must still call generate() the same number of times)
    # first call: rank 0 finishes early, rank 1 runs to the budget; second call: both finish early
    both_early = sc.early[min(rank, len(sc.early) - 1)][0]
    prompts = [sc.early[0][0] if rank == 0 else sc.late[0], both_early]
    lengths, forwards = [], []
    model.eval()
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=sc.steps,
                do_sample=False,
                eos_token_id=sc.eos_token_id,
                pad_token_id=0,
            )
        lengths.append(out.shape[1] - len(p))
        forwards.append(model.hf_zero3_last_generate.forwards)
    return dict(
        rank=rank,
        losses=train_losses(trainer),
        eval_loss=eval_loss,
        train_s=train_s,
        lengths=lengths,
        forwards=forwards,
        steps=sc.steps,
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
