"""TRL rollouts under ZeRO-3: GRPO rollout and step time, TRL alone vs with ``Zero3Safe``, and
DeepSpeed's OPSD rollout (``HybridEngineRollout``) with fixed steps vs hf_zero3's early stop.

GRPO (every GPU up to 2, NCCL; CPU/gloo with a tiny model if none): Qwen2-0.5B shape built in code
(random weights, bf16), TRL's default GRPOConfig apart from sizes: ``BENCH_COMPLETIONS`` (default
64 on CUDA, 8 on CPU) completions of <= 128 tokens per rank and per step, 8 per prompt, 3 steps
(the first warms up and compiles). The prompts are conversations TRL formats with the Qwen2.5 chat
template, left-padded to mixed lengths (``prompt_lengths``: the first rollout's shortest and
longest without padding); ``prefill``: whether the last rollout's prompt forward ran compiled.
Settings (``BENCH_TRL_SETTINGS``, comma-separated; default all):
``trl_default`` (``ds3_gather_for_generation=True``, TRL's eager rollout: the baseline),
``trl_gather_off``, ``zero3safe`` and ``zero3safe_gather_off`` (``callbacks=[Zero3Safe()]``; its
default ``decode="auto"`` takes hf_zero3's static loop in the gathered rollouts on CUDA), and
``zero3safe_step_compiled`` / ``zero3safe_step_layers`` (``Zero3Safe`` with the rollouts'
decode step compiled whole / as one compiled decoder layer for every layer, where the rollouts'
default runs it eagerly: ``DecodeOptions.compile_step`` / ``compile_layers``) and
``zero3safe_deepcompile`` (the same under DeepCompile ZeRO-3, ``torch_compile=True``). The rollout
phase is the time spent in ``generate()`` in a step, the fastest of steps 2-3 (``BENCH_STEPS``: steps a
setting trains, default 3; ``first_rollout_s``: the first step's, compiles included); step: the
fastest of steps 2-3;
``train_s``: a step less its ``_prepare_inputs`` (TRL's rollout, scoring and gathering), the
fastest of steps 2-3: the training, TRL's own in every setting; ``vs_trl_default_*``:
trl_default's time over the row's; ``vs_trl_default_step_bound``: trl_default's step over the row's
training, the most a faster rollout alone could make ``vs_trl_default_step``.
``BENCH_TRL_ZERO3`` picks GRPO's ZeRO-3 config (``grpo_zero3`` in the rows): ``strict`` (default;
no persistence, prefetch or reuse, so each forward all-gathers each layer as on a
multi-billion-parameter model; AdamW from DeepSpeed) or ``deepspeed`` (DeepSpeed's own stage-3
defaults and the Trainer's optimizer, what an accelerate config with ``zero_stage: 3`` gives; on
one GPU a 0.5B model then stays gathered between uses).

OPSD rollout: the same model in a ZeRO-3 engine, greedy, batch 8, 64-token prompts, 128 new
tokens; row i of rank r emits EOS at step (0.1 + 0.08 i + 0.03 r) x 128 (the model's forward
raises the EOS logit from then on, as rollouts end at different lengths), so the group's last row
ends at step 84 (one rank) or 88 (two). DeepSpeed's rollout runs all 128 forwards;
``hf_zero3.trl.early_stop`` stops after the group's longest row (its default stop checks;
``decode="auto"``: the static loop on CUDA where the model is gathered for the call;
``BENCH_OPSD_DECODE=compiled`` takes it on CPU too). ``same_lengths``: every row ends where
DeepSpeed's does; ``same_output``: token for token (in bf16 on a GPU the compiled loop's kernels
may break a near tie of the random model's logits otherwise than eager decoding; the fp32 CPU
tests check tokens). ``compiles``: Dynamo graphs the timed call compiled (0 unless something
recompiled); ``first_call_s``: the untimed first call's seconds, compiles included.
Rows go to trl.jsonl with ``part`` "grpo" or "opsd". ``BENCH_TRL_ONLY=opsd`` (or ``grpo``) runs
one part alone. ``BENCH_TIMEOUT`` (seconds, default 590) bounds each part; past it, each rank's
stack is reported.
Run: python benchmarks/trl/bench_trl.py
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import record, scratch_dir, table, world_and_backend  # noqa: E402

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW", 128))
TIMEOUT = float(os.environ.get("BENCH_TIMEOUT", 590))  # a part's hard limit: past it, each rank's stack is reported
STEPS = int(os.environ.get("BENCH_STEPS", 3))  # GRPO steps a setting trains; the first warms up
# name -> (ds3_gather_for_generation, Zero3Safe, DeepCompile, the rollouts' DecodeOptions fields)
SETTINGS = {
    "trl_default": (True, False, False, {}),
    "trl_gather_off": (False, False, False, {}),
    "zero3safe": (True, True, False, {}),
    "zero3safe_gather_off": (False, True, False, {}),
    "zero3safe_step_compiled": (True, True, False, {"compile_step": True}),
    "zero3safe_step_layers": (True, True, False, {"compile_step": True, "compile_layers": True}),
    "zero3safe_deepcompile": (True, True, True, {}),
}
# GRPO's DeepSpeed config: "strict" (no persistence, prefetch or reuse: each forward all-gathers each
# layer, as on a multi-billion-parameter model) or "deepspeed" (DeepSpeed's own stage-3 defaults and
# the Trainer's optimizer, what an accelerate config with zero_stage 3 gives a 0.5B model on one GPU)
ZERO3 = os.environ.get("BENCH_TRL_ZERO3", "strict")
if ZERO3 not in ("strict", "deepspeed"):
    raise SystemExit(f"BENCH_TRL_ZERO3 takes strict or deepspeed, not {ZERO3!r}")
_asked = os.environ.get("BENCH_TRL_SETTINGS", ",".join(SETTINGS)).split(",")
if set(_asked) - set(SETTINGS) or "trl_default" not in _asked:
    raise SystemExit(f"BENCH_TRL_SETTINGS takes names of {', '.join(SETTINGS)}, trl_default (the baseline) among them")


# GRPO's model on CUDA: "qwen2" (Qwen2.5-0.5B's sizes) or "qwen3_moe" (Qwen3-30B-A3B's sizes, 128
# experts top-8, BENCH_TRL_MOE_LAYERS layers, default 2: what one GPU trains with AdamW states)
MODEL = os.environ.get("BENCH_TRL_MODEL", "qwen2")
if MODEL not in ("qwen2", "qwen3_moe"):
    raise SystemExit(f"BENCH_TRL_MODEL takes qwen2 or qwen3_moe, not {MODEL!r}")


def _config(cuda: bool, vocab: int):
    from hf_zero3.testing import models

    if not cuda:
        return models.tiny_qwen2_config(vocab_size=vocab, max_position_embeddings=1024)
    if MODEL == "qwen3_moe":
        layers = int(os.environ.get("BENCH_TRL_MOE_LAYERS", 2))
        return models.qwen3_moe_shape_config(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=2048)
    # the rows' model: Qwen2.5-0.5B's sizes with RoPE base 10000 and 2048 positions
    return models.qwen2_0_5b_shape_config(vocab_size=vocab, max_position_embeddings=2048, rope_theta=10_000.0)


def _eos_at_class():
    import torch
    from transformers import Qwen2ForCausalLM

    class EosAt(Qwen2ForCausalLM):
        """Qwen2 whose row i emits EOS (id 2) at generated step ``targets[i]``, as a rollout's rows end
        at different lengths: its forward raises the EOS logit from that step on (tensor-only, so a
        compiled decode step computes it too); greedy and otherwise untouched. ``prompt_len``: the
        rollout's prompt length."""

        targets = None  # (batch,) long tensor on the model's device
        prompt_len = 64

        def forward(self, *args, **kwargs):
            positions = kwargs.get("position_ids")
            if positions is not None:  # hf_zero3's static loop passes them
                last = positions[:, -1]
            else:  # transformers' loop without an attention mask: the cache's length before this forward
                from hf_zero3._upstream import transformers as hf_up

                cache, ids = hf_up.passed_cache(kwargs), kwargs.get("input_ids", args[0] if args else None)
                last = (cache.get_seq_length() if cache is not None else 0) + ids.shape[1] - 1
            out = super().forward(*args, **kwargs)
            if self.targets is None:
                return out
            step = last - (self.prompt_len - 2)  # the prompt's last position makes token 1
            force = (step >= self.targets).to(out.logits.dtype) * 1e4
            bonus = torch.zeros_like(out.logits[:, -1:])
            bonus[..., 2] = 1.0
            out.logits = out.logits + bonus * force[:, None, None]
            return out

    return EosAt


def _call_record(last, seconds: float) -> dict:
    """One generate() call's seconds and, for hf_zero3's loop, whether it reused the loop's buffers
    and CUDA graphs or built and captured them again (a rollout slower than its neighbours says why)."""
    row = {"s": round(seconds, 4)}
    if last is not None and last.loop == "hf_zero3":
        row.update(
            loop_reused=last.loop_reused,
            graphs_reused=last.graphs_reused,
            graphs_moved=list(last.graphs_moved),
            graph_capture_s=round(last.graph_capture_s, 4),
            compiles=last.compiles,
            step=last.step,
            graph_reason=last.graph_reason,
        )
    return row


class _Timer:
    """Times generate() calls and the tokens they add; times whole optimizer steps, and the part of
    each outside the trainer's ``_prepare_inputs`` (TRL's rollout, scoring and gathering): its training."""

    def __init__(self, sync):
        self.sync, self.gen_s, self.tokens, self.steps, self._t = sync, 0.0, 0, [], None
        self.step_gen, self.gen_steps = 0.0, []  # generate() seconds in the current step, per step
        self.step_prepare, self.train_steps = 0.0, []  # _prepare_inputs seconds; step less them, per step
        self.step_compiles, self.compiles = 0, []  # Dynamo graphs the step's generate() calls compiled
        self.prompt_lengths = None  # the first rollout's prompt lengths without padding: [shortest, longest]
        self.calls = []  # per generate() call: its seconds and what hf_zero3's loop reused or redid

    def _timed(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` and its seconds, the device synchronized on both sides."""
        self.sync()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return out, time.perf_counter() - t

    def wrap(self, model):
        original = model.generate

        def generate(*args, **kwargs):
            out, dt = self._timed(original, *args, **kwargs)
            self.gen_s += dt
            self.step_gen += dt
            last = getattr(model, "hf_zero3_last_generate", None)
            self.step_compiles += getattr(last, "compiles", 0) or 0
            self.calls.append(_call_record(last, dt))
            prompt = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
            mask = kwargs.get("attention_mask")
            if self.prompt_lengths is None and mask is not None:
                real = mask.sum(-1)
                self.prompt_lengths = [int(real.min()), int(real.max())]
            self.tokens += out.shape[0] * (out.shape[1] - prompt)
            return out

        model.generate = generate

    def wrap_prepare(self, trainer):
        original = trainer._prepare_inputs

        def prepare(*args, **kwargs):
            out, dt = self._timed(original, *args, **kwargs)
            self.step_prepare += dt
            return out

        trainer._prepare_inputs = prepare

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, *a, **k):
                timer.sync()
                timer._t = time.perf_counter()
                timer.step_gen, timer.step_compiles, timer.step_prepare = 0.0, 0, 0.0

            def on_step_end(self, *a, **k):
                timer.sync()
                timer.steps.append(time.perf_counter() - timer._t)
                timer.train_steps.append(timer.steps[-1] - timer.step_prepare)
                timer.gen_steps.append(timer.step_gen)
                timer.compiles.append(timer.step_compiles)

        return StepTimes()


def grpo_rank(tmpdir: str):
    import torch
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import chat_prompts, length_reward, mark, models, tiny_tokenizer, trainer_zero3_config

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tok = tiny_tokenizer()
    completions = int(os.environ.get("BENCH_COMPLETIONS", 64 if cuda else 8))
    rows = []
    for name in _asked:
        gather, fixed, deepcompile, decode = SETTINGS[name]
        mark(f"grpo {name}")
        timer = _Timer(sync)
        options = {"decode_options": hf_zero3.DecodeOptions(**decode)} if decode else {}
        callbacks = [timer.callback()] + ([hf_zero3.Zero3Safe(**options)] if fixed else [])
        # bf16 as TRL's and accelerate's DeepSpeed configs set it (without the key DeepSpeed trains fp32)
        ds = trainer_zero3_config(extra={"bf16": {"enabled": "auto"}})
        if ZERO3 == "deepspeed":
            ds = {k: v for k, v in ds.items() if k != "optimizer"}
            ds["zero_optimization"] = {"stage": 3}
        if deepcompile:
            ds["compile"] = {"deepcompile": True}
        args = GRPOConfig(
            output_dir=f"{tmpdir}/{name}",
            use_cpu=not cuda,
            bf16=cuda,
            deepspeed=ds,
            torch_compile=deepcompile,
            per_device_train_batch_size=completions,
            num_generations=8,
            max_completion_length=MAX_NEW,
            max_steps=STEPS,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            ds3_gather_for_generation=gather,
            seed=0,
        )
        torch.manual_seed(0)
        cfg = _config(cuda, 151936 if cuda else len(tok))
        model = models.model_class_for(cfg)._from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=chat_prompts(),
            processing_class=tok,
            callbacks=callbacks,
        )
        timer.wrap(trainer.model)
        timer.wrap_prepare(trainer)
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
        rt = hf_zero3.runtime_of(trainer.model, create=False)
        last = rt.generation.last if rt is not None else None
        rows.append(
            dict(
                setting=name,
                gather=gather,
                zero3safe=fixed,
                deepcompile=deepcompile,
                decode_options=decode,
                completions=completions,
                rank=dist.get_rank(),
                loop=last.loop if last is not None else "transformers",
                decode=last.decode if last is not None else "eager",
                prefill=last.prefill if last is not None else "eager",
                step=last.step if last is not None else "eager",
                graph_steps=last.graph_steps if last is not None else 0,
                graphs_reused=last.graphs_reused if last is not None else False,
                graph_capture_s=last.graph_capture_s if last is not None else 0.0,
                graph_reason=last.graph_reason if last is not None else None,
                experts=last.decode_report.experts if last is not None else None,
                prompt_lengths=timer.prompt_lengths,
                rollout_tokens_per_s=timer.tokens / timer.gen_s if timer.gen_s else None,
                rollout_s=min(timer.gen_steps[1:]),
                first_rollout_s=timer.gen_steps[0],
                rollout_s_all=timer.gen_steps,
                generate_calls=timer.calls,
                step_s_all=timer.steps,
                compiles_per_step=timer.compiles,
                generate_s=timer.gen_s,
                tokens=timer.tokens,
                step_s=min(timer.steps[1:]),
                train_s=min(timer.train_steps[1:]),
                train_s_all=timer.train_steps,
            )
        )
        if dist.get_rank() == 0:  # as it is measured: a run cut short keeps its rows
            with open(os.path.join(scratch_dir(), "trl_partial.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
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
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    dev = engine.device
    targets = [max(2, int((0.1 + 0.08 * i + 0.03 * dist.get_rank()) * MAX_NEW)) for i in range(8)]
    model.targets = torch.tensor(targets, device=dev)
    g = torch.Generator().manual_seed(dist.get_rank())
    prompt = torch.randint(3, cfg.vocab_size, (8, 64), generator=g).to(dev)
    request = RolloutRequest(prompt, torch.ones_like(prompt))
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0)
    tok = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": 0})()  # the rollout reads these two
    rollout = HybridEngineRollout(engine, tok)
    # DeepSpeed's forwards, counted by a hook; the hook is removed before the static loop compiles
    # the forward: a hook that changes a Python counter is traced into the graph, which Dynamo then
    # recompiles at every call (the loop reports its own count)
    forwards = [0]
    counting = engine.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    rows = []
    for name in ("deepspeed_fixed", "hf_zero3_early_stop"):
        if name == "hf_zero3_early_stop":
            counting.remove()
            hf_zero3.trl.early_stop(rollout, decode=os.environ.get("BENCH_OPSD_DECODE", "auto"))
        sync()
        t = time.perf_counter()
        rollout.generate(request, sampling)  # warm: compiles where the loop compiles
        sync()
        first = time.perf_counter() - t
        forwards[0] = 0
        sync()
        t = time.perf_counter()
        batch = rollout.generate(request, sampling)
        sync()
        dt = time.perf_counter() - t
        lengths = batch.attention_mask[:, 64:].sum(1).cpu().tolist()  # each row's response tokens
        useful = sum(lengths)
        last = getattr(engine.module, "hf_zero3_last_generate", None)
        ours = last is not None and name != "deepspeed_fixed"
        rows.append(
            dict(
                setting=name,
                loop=last.loop if ours else "transformers",
                forwards=last.forwards if ours else forwards[0],
                compiles=last.compiles if ours else 0,  # in the timed call: 0 unless something recompiled
                first_call_s=first,
                seconds=dt,
                useful_tokens=useful,
                useful_tokens_per_s=useful / dt,
                ids=batch.input_ids.cpu().tolist(),
                lengths=lengths,
            )
        )
    rows[1]["same_lengths"] = rows[0]["lengths"] == rows[1]["lengths"]
    rows[1]["same_output"] = rows[0]["ids"] == rows[1]["ids"]
    for r in rows:
        r.pop("ids")
        r.pop("lengths")
    return rows


def main():
    import tempfile

    from hf_zero3.testing import run_ranks

    world, backend = world_and_backend()
    setup = dict(
        world=world,
        backend=backend,
        max_new_tokens=MAX_NEW,
        model=("qwen3-moe-shape" if MODEL == "qwen3_moe" else "qwen2-0.5b-shape")
        if backend == "nccl"
        else "tiny-qwen2",
        grpo_zero3=ZERO3,
    )
    rows = []
    only = os.environ.get("BENCH_TRL_ONLY")
    if only != "opsd":
        grpo = run_ranks(
            grpo_rank,
            world,
            args=(tempfile.mkdtemp(),),
            backend=backend,
            init="deepspeed",
            timeout=TIMEOUT,
            pg_timeout=300,
        )
        rows = [dict(r, part="grpo") for rank_rows in grpo for r in rank_rows]
        base = next(r for r in rows if r["setting"] == "trl_default" and r["rank"] == 0)
        for r in rows:
            r["vs_trl_default_rollout"] = base["rollout_s"] / r["rollout_s"]
            r["vs_trl_default_step"] = base["step_s"] / r["step_s"]
            r["vs_trl_default_step_bound"] = base["step_s"] / r["train_s"]
        print(
            table(
                rows,
                [
                    "setting",
                    "rank",
                    "loop",
                    "prefill",
                    "step",
                    "graph_steps",
                    "first_rollout_s",
                    "rollout_s",
                    "step_s",
                    "train_s",
                    "vs_trl_default_rollout",
                    "vs_trl_default_step",
                    "vs_trl_default_step_bound",
                ],
            )
        )
    opsd = []
    if only != "grpo":
        opsd = run_ranks(opsd_rank, world, backend=backend, init="deepspeed", timeout=TIMEOUT, pg_timeout=300)[0]
        opsd[1]["speedup"] = opsd[0]["seconds"] / opsd[1]["seconds"]
        print(
            table(
                opsd,
                [
                    "setting",
                    "loop",
                    "forwards",
                    "compiles",
                    "first_call_s",
                    "seconds",
                    "useful_tokens_per_s",
                    "speedup",
                    "same_lengths",
                    "same_output",
                ],
            )
        )
    path = record("trl", rows + [dict(r, part="opsd") for r in opsd], HERE, setup)
    print(setup)
    print(f"raw rows appended to {path}")


if __name__ == "__main__":
    main()
