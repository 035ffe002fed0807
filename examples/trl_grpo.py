"""TRL's GRPOTrainer under DeepSpeed ZeRO-3, made safe by one callback: hf_zero3.Zero3Safe().

    torchrun --nproc_per_node 2 examples/trl_grpo.py            # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node 2 examples/trl_grpo.py --tools    # rank 0 alone calls a tool

Under ZeRO-3 every generate() is a collective (TRL gathers the model for it, or every decode
forward gathers each layer with --no-gather), so every rank must generate the same number of
times, and for the same number of steps. TRL does not guarantee either: a rank's completions end
at their own EOS, and its tool loop generates again only on the ranks whose completions called a
tool. ``callbacks=[Zero3Safe()]`` applies ``hf_zero3.trl.apply``: generation runs in lockstep (it
stops when every rank's rows have ended, reusing the model TRL already gathered) and a rank whose
tool loop is over joins the other ranks' extra rounds with a placeholder generation.

With ``--tools`` the model is scripted (``hf_zero3.testing.trl_jobs.RankScript("tool")``) so that
rank 0's completions call the ``ping`` tool and rank 1's never do: rank 0 runs one more
generate() per step than rank 1 would, the case that crashes or hangs without Zero3Safe.

Nothing is downloaded: the tokenizer is hf_zero3.testing.trl_jobs' byte-level one with TRL's
Qwen2.5 chat template, and the model a Qwen2 with random weights built from its config (tiny on
CPU, Qwen2.5-0.5B's shape on GPU; ``--model`` picks), so rewards and losses mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# reuse the DeepSpeed CPU comm op the test suite builds (a cold JIT build takes ~35 s)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

PROMPTS = [
    "Say hi.",
    "Count to 3.",
    "Name a color.",
    "Add 2 and 2.",
    "Spell cat.",
    "Pick a number.",
    "Say bye.",
    "Name a fruit.",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", action="store_true", help="tools=[ping]; rank 0 alone calls it")
    p.add_argument(
        "--no-gather", action="store_true", help="ds3_gather_for_generation=False (hf_zero3 then gathers for each call)"
    )
    p.add_argument(
        "--model",
        choices=("auto", "tiny", "0.5b"),
        default="auto",
        help="auto: tiny on CPU, Qwen2.5-0.5B's shape on GPU (training that in fp32 on "
        "CPU takes more than 24 GB of memory)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--output-dir", default=None)
    return p.parse_args()


def qwen2_config(size: str, tokenizer):
    from transformers import Qwen2Config

    from hf_zero3.testing import models

    if size == "tiny":
        return models.tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
    # Qwen2.5-0.5B (494M parameters); the tokenizer's ids 0/1/2 are pad/bos/eos
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    import deepspeed
    import torch.distributed as dist
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import trainer_zero3_config
    from hf_zero3.testing.trl_jobs import RankScript, ScriptedQwen2ForCausalLM, length_reward, ping, tiny_tokenizer

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    # DeepSpeed ZeRO-3 with nothing kept gathered between uses (as on a multi-billion model)
    ds_config = trainer_zero3_config(extra={"bf16": {"enabled": "auto"}})
    training_args = GRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl_grpo_"),
        use_cpu=not cuda,
        bf16=cuda,
        deepspeed=ds_config,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=80 if args.tools else 16,
        ds3_gather_for_generation=not args.no_gather,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    tokenizer = tiny_tokenizer()
    size = args.model if args.model != "auto" else ("0.5b" if cuda else "tiny")
    # built after GRPOConfig: its DeepSpeed config makes transformers partition the model as it
    # is created (deepspeed.zero.Init), as from_pretrained would
    torch.manual_seed(0)
    model = ScriptedQwen2ForCausalLM._from_config(
        qwen2_config(size, tokenizer), dtype=torch.bfloat16 if cuda else torch.float32
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if args.tools:
        model.script = RankScript("tool", tokenizer)  # rank 0 calls ping, the others never

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[ping] if args.tools else None,
        callbacks=[hf_zero3.Zero3Safe()],
    )
    trainer.train()

    stats = model.generate_stats or {"calls": 0, "forwards": 0, "per_call": []}
    last = hf_zero3.runtime_of(trainer.model).last_generate
    losses = [round(h["loss"], 8) for h in trainer.state.log_history if "loss" in h]
    tool_calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    for r in range(world):  # one line per rank, in rank order
        if r == rank:
            print(
                f"[rank {rank}/{world}] model {size} ({sum(p.ds_numel for p in model.parameters()):,} "
                f"params) generate() calls {stats['calls']}, decode forwards {stats['forwards']} "
                f"{stats['per_call']}, last gather: {last.gather if last else None}, losses {losses}"
                + (f", tool call frequency {tool_calls}" if args.tools else ""),
                flush=True,
            )
        dist.barrier()
    seen = [None] * world
    dist.all_gather_object(seen, (stats["calls"], stats["per_call"]))
    if rank == 0:
        same = all(s == seen[0] for s in seen)
        print(
            "every rank ran the same generate() calls and decode forwards: " + ("yes" if same else f"NO: {seen}"),
            flush=True,
        )


if __name__ == "__main__":
    main()
