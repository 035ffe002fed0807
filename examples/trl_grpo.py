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

With ``--tools`` the model is scripted (:class:`RankZeroCallsTheTool`) so that rank 0's
completions call the ``ping`` tool and rank 1's never do: rank 0 runs one more generate() per step
than rank 1 would, the case that crashes or hangs without Zero3Safe.

Nothing is downloaded: the tokenizer is ``hf_zero3.testing.tiny_tokenizer()``, byte-level with
TRL's Qwen2.5 chat template, and the model a Qwen2 with random weights built from its config (tiny
on CPU, Qwen2.5-0.5B's shape on GPU; ``--model`` picks), so rewards and losses mean nothing.
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

import torch.distributed as dist  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM  # noqa: E402

from hf_zero3.testing import ForwardCounter, chat_prompts, length_reward  # noqa: E402

TOOL_CALL = '<tool_call>{"name":"ping","arguments":{}}</tool_call>'


def ping() -> str:
    """Answer with pong."""
    return "pong"


class RankZeroCallsTheTool(LogitsProcessor):
    """Rank 0's rows write :data:`TOOL_CALL` and end, and end at once after the tool's answer; the
    other ranks' rows can never open a tool call. TRL's tool loop then generates once more on
    rank 0 than on the others."""

    def __init__(self, tokenizer, prompt_len: int):
        self.prompt_len, self.rank0 = prompt_len, dist.get_rank() == 0
        self.eos = tokenizer.eos_token_id
        self.call = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [self.eos]
        self.call_open = tokenizer.convert_tokens_to_ids("<tool_call>")
        self.tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.plans = None  # per row: the tokens rank 0 writes

    def __call__(self, input_ids, scores):
        if not self.rank0:
            scores[:, self.call_open] = float("-inf")
            return scores
        if self.plans is None:  # from the first step's rows: they may outnumber the prompts
            prompts = input_ids[:, : self.prompt_len].tolist()
            # the post-tool turn (its prompt holds the tool's answer) ends at once
            self.plans = [[self.eos] if self.tool_response in p else self.call for p in prompts]
        step = input_ids.shape[1] - self.prompt_len
        for row, plan in enumerate(self.plans):
            if step < len(plan):
                scores[row] = float("-inf")
                scores[row, plan[step]] = 0.0
        return scores


class CountingQwen2(Qwen2ForCausalLM):
    """Qwen2 that records the decode forwards of each generate() call (``forwards``) and, with
    ``tools_tokenizer`` set, adds :class:`RankZeroCallsTheTool` to each call (TRL's configs take
    no logits processor, so the model carries it)."""

    tools_tokenizer = None

    def generate(self, *args, **kwargs):
        if self.tools_tokenizer is not None:
            prompt = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            script = RankZeroCallsTheTool(self.tools_tokenizer, prompt.shape[1])
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), script])
        counter = ForwardCounter(self)
        try:
            return super().generate(*args, **kwargs)
        finally:
            counter.remove()
            self.forwards.append(counter.take())


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


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    import deepspeed
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import qwen2_0_5b_shape_config, tiny_qwen2_config, tiny_tokenizer, trainer_zero3_config

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
    if size == "tiny":
        config = tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
    else:  # Qwen2.5-0.5B (494M parameters); the tokenizer's ids 0/1/2 are its pad/bos/eos
        config = qwen2_0_5b_shape_config()
    torch.manual_seed(0)
    model = CountingQwen2._from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.forwards = []
    if args.tools:
        model.tools_tokenizer = tokenizer  # rank 0 calls ping, the others never

    dataset = chat_prompts()
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

    last = hf_zero3.runtime_of(trainer.model).generation.last
    losses = [round(h["loss"], 8) for h in trainer.state.log_history if "loss" in h]
    tool_calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    for r in range(world):  # one line per rank, in rank order
        if r == rank:
            print(
                f"[rank {rank}/{world}] model {size} ({sum(p.ds_numel for p in model.parameters()):,} "
                f"params) generate() calls {len(model.forwards)}, decode forwards {sum(model.forwards)} "
                f"{model.forwards}, last gather: {last.gather if last else None}, losses {losses}"
                + (f", tool call frequency {tool_calls}" if args.tools else ""),
                flush=True,
            )
        dist.barrier()
    seen = [None] * world
    dist.all_gather_object(seen, model.forwards)
    if rank == 0:
        same = all(s == seen[0] for s in seen)
        print(
            "every rank ran the same generate() calls and decode forwards: " + ("yes" if same else f"NO: {seen}"),
            flush=True,
        )
    # End as torch documents: every rank past its last collective, then the groups destroyed while
    # the interpreter is whole. gloo drops a finished collective's tensors on its own thread, which
    # takes the GIL to do it; one still doing so at interpreter shutdown aborts the process
    # (pytorch/pytorch#190489). The barrier holds no Python tensors and gives that thread the GIL.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
