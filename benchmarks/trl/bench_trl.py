"""TRL rollouts under ZeRO-3: GRPO generation throughput and step time, TRL alone vs with
``Zero3Safe``, and DeepSpeed's OPSD rollout (``HybridEngineRollout``) with fixed steps vs
hf_zero3's early stop.

GRPO (every GPU up to 2, NCCL; CPU/gloo with a tiny model if none): Qwen2-0.5B shape built in code
(random weights, bf16), TRL's default GRPOConfig but 8 completions of <= 128 tokens per rank and
per step, 3 steps (the first warms up); four settings in one run: TRL default
(``ds3_gather_for_generation=True``, the baseline), TRL with gather off, and both with
``callbacks=[Zero3Safe()]``. Rollout tokens/s counts generated tokens per rank over the time spent
in ``generate()``; step: the fastest of steps 2-3.

OPSD rollout: the same model in a ZeRO-3 engine, greedy, batch 8, 64-token prompts, 128 new
tokens; row i of rank r emits EOS at step (0.1 + 0.08 i + 0.03 r) x 128 (a logits processor in the
model's generate(), as rollouts end at different lengths), so the group's last row ends at step 84
(one rank) or 88 (two). DeepSpeed's rollout runs all 128 forwards; ``hf_zero3.trl.early_stop``
stops at the group's longest row; outputs compared token for token.
Rows go to trl.jsonl with ``part`` "grpo" or "opsd". ``BENCH_TRL_ONLY=opsd`` runs the OPSD part alone.
Run: python benchmarks/trl/bench_trl.py
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import record, table, world_and_backend  # noqa: E402

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW", 128))
SETTINGS = [
    ("trl_default", True, False),
    ("trl_gather_off", False, False),
    ("zero3safe", True, True),
    ("zero3safe_gather_off", False, True),
]


def _config(cuda: bool, vocab: int):
    from transformers import Qwen2Config

    if not cuda:
        from hf_zero3.testing import models

        return models.tiny_qwen2_config(vocab_size=vocab, max_position_embeddings=1024)
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _eos_at_class():
    from transformers import LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM

    class ForceEos(LogitsProcessor):
        def __init__(self, targets, prompt_len):
            self.targets, self.prompt_len = targets, prompt_len

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_len
            for row, target in enumerate(self.targets):
                if step + 1 == target:
                    scores[row] = float("-inf")
                    scores[row, 2] = 0.0
            return scores

    class EosAt(Qwen2ForCausalLM):
        """Qwen2 whose row i emits EOS (id 2) at generated step ``targets[i]``, as a rollout's rows end
        at different lengths; greedy and otherwise untouched."""

        targets: list = []

        def generate(self, input_ids, **kwargs):
            processors = LogitsProcessorList(
                [*(kwargs.pop("logits_processor", None) or []), ForceEos(self.targets, input_ids.shape[1])]
            )
            return super().generate(input_ids, logits_processor=processors, **kwargs)

    return EosAt


class _Timer:
    """Times generate() calls and the tokens they add; times whole optimizer steps."""

    def __init__(self, sync):
        self.sync, self.gen_s, self.tokens, self.steps, self._t = sync, 0.0, 0, [], None

    def wrap(self, model):
        original = model.generate

        def generate(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            out = original(*args, **kwargs)
            self.sync()
            self.gen_s += time.perf_counter() - t
            prompt = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
            self.tokens += out.shape[0] * (out.shape[1] - prompt)
            return out

        model.generate = generate

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, *a, **k):
                timer.sync()
                timer._t = time.perf_counter()

            def on_step_end(self, *a, **k):
                timer.sync()
                timer.steps.append(time.perf_counter() - timer._t)

        return StepTimes()


def grpo_rank(tmpdir: str):
    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import mark
    from hf_zero3.testing.configs import trainer_zero3_config
    from hf_zero3.testing.trl_jobs import _prompts, length_reward, tiny_tokenizer

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tok = tiny_tokenizer()
    rows = []
    for name, gather, fixed in SETTINGS:
        mark(f"grpo {name}")
        timer = _Timer(sync)
        callbacks = [timer.callback()] + ([hf_zero3.Zero3Safe()] if fixed else [])
        args = GRPOConfig(
            output_dir=f"{tmpdir}/{name}",
            use_cpu=not cuda,
            bf16=cuda,
            deepspeed=trainer_zero3_config(),
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=MAX_NEW,
            max_steps=3,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            ds3_gather_for_generation=gather,
            seed=0,
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM._from_config(
            _config(cuda, 151936 if cuda else len(tok)), dtype=torch.bfloat16 if cuda else torch.float32
        )
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=_prompts(),
            processing_class=tok,
            callbacks=callbacks,
        )
        timer.wrap(trainer.model)
        first = {}
        orig_train_step = trainer.training_step

        def training_step(*a, **k):  # the first step warms up: reset the generation timers after it
            out = orig_train_step(*a, **k)
            if not first:
                first["done"] = True
                timer.gen_s, timer.tokens = 0.0, 0
            return out

        trainer.training_step = training_step
        trainer.train()
        rows.append(
            dict(
                setting=name,
                gather=gather,
                zero3safe=fixed,
                rank=dist.get_rank(),
                rollout_tokens_per_s=timer.tokens / timer.gen_s if timer.gen_s else None,
                generate_s=timer.gen_s,
                tokens=timer.tokens,
                step_s=min(timer.steps[1:]),
            )
        )
        del trainer, model
        if cuda:
            torch.cuda.empty_cache()
    return rows


def opsd_rank():
    """DeepSpeed's rollout, fixed steps vs early stop (see the module docstring)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    import hf_zero3
    from hf_zero3.testing import models

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _EosAt = _eos_at_class()
    cfg = _config(cuda, 151936 if cuda else 512)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": cuda},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    models.ensure_deepspeed_comm()
    model = _EosAt._from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    # row i of rank r ends at step (0.1 + 0.08 i + 0.03 r) x MAX_NEW: the group's last row at ~0.7 x MAX_NEW
    model.targets = [max(2, int((0.1 + 0.08 * i + 0.03 * dist.get_rank()) * MAX_NEW)) for i in range(8)]
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    dev = engine.device
    g = torch.Generator().manual_seed(dist.get_rank())
    prompt = torch.randint(3, cfg.vocab_size, (8, 64), generator=g).to(dev)
    request = RolloutRequest(prompt, torch.ones_like(prompt))
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0)
    tok = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": 0})()  # the rollout reads these two
    rollout = HybridEngineRollout(engine, tok)
    forwards = [0]
    engine.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    rows = []
    for name in ("deepspeed_fixed", "hf_zero3_early_stop"):
        if name == "hf_zero3_early_stop":
            hf_zero3.trl.early_stop(rollout)
        rollout.generate(request, sampling)  # warm
        forwards[0] = 0
        sync()
        t = time.perf_counter()
        batch = rollout.generate(request, sampling)
        sync()
        dt = time.perf_counter() - t
        useful = int(batch.attention_mask[:, 64:].sum())
        rows.append(
            dict(
                setting=name,
                forwards=forwards[0],
                seconds=dt,
                useful_tokens=useful,
                useful_tokens_per_s=useful / dt,
                ids=batch.input_ids.cpu().tolist(),
            )
        )
    rows[1]["same_output"] = rows[0]["ids"] == rows[1]["ids"]
    for r in rows:
        r.pop("ids")
    return rows


def main():
    import tempfile

    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend()
    setup = dict(
        world=world,
        backend=backend,
        max_new_tokens=MAX_NEW,
        model="qwen2-0.5b-shape" if backend == "nccl" else "tiny-qwen2",
    )
    rows = []
    if os.environ.get("BENCH_TRL_ONLY") != "opsd":
        grpo = run_ranks(
            grpo_rank, world, args=(tempfile.mkdtemp(),), backend=backend, init="deepspeed", timeout=590, pg_timeout=300
        )
        rows = [dict(r, part="grpo") for rank_rows in grpo for r in rank_rows]
        base = next(r for r in rows if r["setting"] == "trl_default" and r["rank"] == 0)
        for r in rows:
            r["vs_trl_default_tok_s"] = r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
            r["vs_trl_default_step"] = base["step_s"] / r["step_s"]
        print(
            table(
                rows,
                ["setting", "rank", "rollout_tokens_per_s", "step_s", "vs_trl_default_tok_s", "vs_trl_default_step"],
            )
        )
    opsd = run_ranks(opsd_rank, world, backend=backend, init="deepspeed", timeout=590, pg_timeout=300)[0]
    opsd[1]["speedup"] = opsd[0]["seconds"] / opsd[1]["seconds"]
    print(table(opsd, ["setting", "forwards", "seconds", "useful_tokens_per_s", "speedup", "same_output"]))
    path = record("trl", rows + [dict(r, part="opsd") for r in opsd], HERE, setup)
    print(setup)
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
