"""Tiny but real TRL trainers under strict ZeRO-3, built on every rank of a gloo group.

Each builder returns a ready trainer with TRL's default arguments except what a tiny CPU run
needs (batch sizes, completion length, a few steps, no bf16, no saving or reporting) and with
:func:`~hf_zero3.testing.configs.trainer_zero3_config` as its DeepSpeed config. Each ``run_*``
function builds one, trains it and returns plain data, ready for
``run_ranks(run_grpo, 2, args=(tmpdir,), init="deepspeed")``.

Nothing is downloaded: :func:`~hf_zero3.testing.models.tiny_tokenizer` is a byte-level tokenizer
with TRL's Qwen2.5 chat template (so TRL recognises it and parses tool calls), and the models are
tiny Qwen2s.

Ranks are made to diverge on purpose with :class:`RankScript`, a per-rank script that
:class:`ScriptedQwen2ForCausalLM` adds to every ``generate()`` call as a logits processor (TRL
has no way to pass a logits processor through its configs, so the model class carries it):

* ``"eos"``: rank 0's rows end at their 2nd generated token, the other ranks never emit EOS.
* ``"tool"``: rank 0's rows emit :data:`TOOL_CALL` (a call of :func:`ping`) and then EOS, and end
  at once after the tool's answer; the other ranks' rows can never open a tool call. Rank 0 thus
  runs one more ``generate()`` (the post-tool turn) than the others in TRL's tool loop.
"""

from __future__ import annotations

import random

import torch
from transformers import LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM, TrainerCallback

from ..runtime import runtime_of
from . import models
from .configs import trainer_zero3_config
from .models import tiny_tokenizer
from .spy import ForwardCounter

#: The completion rank 0 is forced to produce under ``RankScript("tool")``.
TOOL_CALL = '<tool_call>{"name":"ping","arguments":{}}</tool_call>'

_PROMPTS = [
    "Say hi.",
    "Count to 3.",
    "Name a color.",
    "Add 2 and 2.",
    "Spell cat.",
    "Pick a number.",
    "Say bye.",
    "Name a fruit.",
]


def ping() -> str:
    """Answer with pong."""
    return "pong"


def length_reward(completions, **kwargs) -> list[float]:
    """A GRPO reward: shorter completions score higher."""
    return [-len(str(c)) / 100.0 for c in completions]


class RankScript:
    """A per-rank decoding script (see the module docstring for ``mode``).

    ``processor(prompt_ids)`` returns a fresh ``LogitsProcessor`` for one ``generate()`` call: at
    generated step ``k`` it either forces a row's planned token (all other logits ``-inf``) or bans
    that row's banned tokens. Plans are per row and follow the row's prompt, so the post-tool turn
    (its prompt holds ``<tool_response>``) gets a different plan from the first turn.
    """

    def __init__(self, mode: str, tokenizer):
        if mode not in ("eos", "tool"):
            raise ValueError(f"mode must be 'eos' or 'tool', not {mode!r}")
        self.mode = mode
        self.eos = tokenizer.eos_token_id
        self.call_open = tokenizer.convert_tokens_to_ids("<tool_call>")
        self.tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.call_ids = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]

    def plan(self, prompt_row: list[int], rank: int) -> tuple[list, list[int]]:
        """``(forced, banned)`` for one row: ``forced[k]`` is step ``k``'s token (``None``: free)."""
        if self.mode == "eos":
            return ([None, self.eos], [self.eos]) if rank == 0 else ([], [self.eos])
        if rank != 0:
            return [], [self.call_open]
        if self.tool_response in prompt_row:  # rank 0's post-tool turn: stop at once
            return [self.eos], []
        return self.call_ids + [self.eos], []

    def processor(self, prompt_ids: torch.Tensor) -> LogitsProcessor:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return _Scripted(self, rank, prompt_ids.shape[1])


class _Scripted(LogitsProcessor):
    def __init__(self, script: RankScript, rank: int, prompt_len: int):
        self.script, self.rank, self.prompt_len = script, rank, prompt_len
        self.plans = None

    def __call__(self, input_ids, scores):
        if self.plans is None:  # from the first step's rows: they may outnumber the prompts
            self.plans = [self.script.plan(row[: self.prompt_len].tolist(), self.rank) for row in input_ids]
        step = input_ids.shape[1] - self.prompt_len
        for row, (forced, banned) in enumerate(self.plans):
            if step < len(forced) and forced[step] is not None:
                scores[row] = float("-inf")
                scores[row, forced[step]] = 0.0
            elif banned:
                scores[row, banned] = float("-inf")
        return scores


class ScriptedQwen2ForCausalLM(Qwen2ForCausalLM):
    """Qwen2 whose ``generate()`` follows ``self.script`` (a :class:`RankScript` or ``None``) and
    counts its calls and the forwards they run in ``self.generate_stats`` (``per_call``: the
    forwards of each call, in order; ``tokens``: each call's generated tokens, row by row, up to
    the row's first EOS; ``loops``: whose decode loop ran each call and why not hf_zero3's, under lockstep)."""

    script: RankScript | None = None
    generate_stats: dict | None = None

    def generate(self, *args, **kwargs):
        stats = self.generate_stats
        if stats is None:
            stats = self.generate_stats = {"calls": 0, "forwards": 0, "per_call": [], "tokens": [], "loops": []}
        stats["calls"] += 1
        prompt_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if self.script is not None:
            kwargs["logits_processor"] = LogitsProcessorList(
                [*(kwargs.get("logits_processor") or []), self.script.processor(prompt_ids)]
            )

        counter = ForwardCounter(self)
        try:
            out = super().generate(*args, **kwargs)
            seqs = getattr(out, "sequences", out)  # return_dict_in_generate (GKD, GOLD)
            eos = self.generation_config.eos_token_id
            stats["tokens"].append([_until_eos(row, eos) for row in seqs[:, prompt_ids.shape[1] :].tolist()])
            rt = runtime_of(self, create=False)
            call = rt.loop if rt is not None else None
            stats["loops"].append((call.stats.loop, call.stats.loop_reason) if call is not None else None)
            return out
        finally:
            counter.remove()
            n = counter.take()
            stats["forwards"] += n
            stats["per_call"].append(n)


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def _model(tokenizer, *, script: str | None = None, teacher: bool = False, seed: int = 0, dtype=None, **config):
    """A tiny Qwen2 (student: scripted; teacher: plain) matching ``tokenizer``; ``config``: sizes or
    attention that differ from :func:`~hf_zero3.testing.models.tiny_qwen2_config` (the GPU tests'),
    ``dtype``: its parameters' (default: torch's).

    Call after the trainer's config exists: its live ``HfDeepSpeedConfig`` makes transformers
    build the model inside ``deepspeed.zero.Init``, partitioned as ``from_pretrained`` would.
    """
    cfg = models.tiny_qwen2_config(**{"vocab_size": len(tokenizer), "max_position_embeddings": 1024, **config})
    torch.manual_seed(seed)
    cls = Qwen2ForCausalLM if teacher else ScriptedQwen2ForCausalLM
    model = cls._from_config(cfg) if dtype is None else cls._from_config(cfg, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if script is not None:
        model.script = RankScript(script, tokenizer)
    return model


def _args(cls, tmpdir: str, **overrides):
    """``cls`` (a TRL config) with its defaults, changed only where a tiny CPU run needs it."""
    torch.set_num_threads(1)  # two ranks share a small CPU
    kw = dict(
        output_dir=tmpdir,
        use_cpu=True,
        bf16=False,
        deepspeed=trainer_zero3_config(),
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return cls(**kw)


def _prompts(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in _PROMPTS[:n]]})


def _conversations(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": f"ok {i}"}]
                for i, p in enumerate(_PROMPTS[:n])
            ]
        }
    )


def grpo_trainer(
    tmpdir: str,
    *,
    gather: bool = True,
    tools: bool = False,
    diverge_eos: bool = False,
    peft: bool = False,
    evaluate: bool = False,
    callbacks=(),
):
    """``trl.GRPOTrainer`` (2 prompts x 2 generations per step, 16 new tokens, 2 steps).

    ``gather``: ``ds3_gather_for_generation``. ``tools=True`` passes ``tools=[ping]`` and scripts
    a tool call on rank 0 only (``RankScript("tool")``; completions get 80 tokens to hold the call
    and the tool's answer). ``diverge_eos=True`` scripts ``RankScript("eos")``. ``peft=True``
    passes ``peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])``: TRL wraps the
    model in a ``PeftModel`` (only the adapters train; TRL's reference model is the base model
    with the adapters disabled). ``evaluate=True`` evaluates after every step on 4 prompts, 2 eval
    batches a rank (GRPO generates for each eval batch).
    """
    from trl import GRPOConfig, GRPOTrainer

    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])

    evals = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2) if evaluate else {}
    args = _args(
        GRPOConfig,
        tmpdir,
        num_generations=2,
        max_completion_length=80 if tools else 16,
        ds3_gather_for_generation=gather,
        **evals,
    )
    tok = tiny_tokenizer()
    model = _model(tok, script="tool" if tools else "eos" if diverge_eos else None)
    return GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=_prompts(),
        eval_dataset=_prompts(4) if evaluate else None,
        processing_class=tok,
        tools=[ping] if tools else None,
        callbacks=list(callbacks),
        peft_config=peft_config,
    )


def rloo_trainer(tmpdir: str, *, diverge_eos: bool = False, evaluate: bool = False, callbacks=()):
    """``trl.RLOOTrainer`` (2 prompts x 2 generations per step, 16 new tokens), ``beta=0`` (TRL's
    0.05 would load a reference model by name, which a model built in code has not); options as in
    :func:`grpo_trainer`."""
    from trl import RLOOConfig, RLOOTrainer

    evals = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2) if evaluate else {}
    args = _args(RLOOConfig, tmpdir, num_generations=2, max_completion_length=16, beta=0.0, **evals)
    tok = tiny_tokenizer()
    model = _model(tok, script="eos" if diverge_eos else None)
    return RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=_prompts(),
        eval_dataset=_prompts(4) if evaluate else None,
        processing_class=tok,
        callbacks=list(callbacks),
    )


class DivergentDraws(TrainerCallback):
    """A callback that seeds Python's ``random`` per rank before the first step, so that
    the first ``random.random() <= lmbda`` is true on rank 0 and false on every other rank."""

    def __init__(self, lmbda: float):
        if not 0.0 < lmbda < 1.0:
            raise ValueError("divergent draws need 0 < lmbda < 1")
        self.lmbda = lmbda
        self.first_draw: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if state.global_step != 0:
            return
        on_policy = dist.get_rank() == 0
        seed = next(s for s in range(10_000) if (random.Random(s).random() <= self.lmbda) == on_policy)
        random.seed(seed)
        self.first_draw = random.Random(seed).random()


class EmbeddingHookCount(TrainerCallback):
    """The forward hooks on the policy's input embeddings after each step (``counts``): constant
    unless something registers one per rollout."""

    def __init__(self):
        self.counts: list[int] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from accelerate.utils import extract_model_from_parallel

        self.counts.append(len(extract_model_from_parallel(model).get_input_embeddings()._forward_hooks))


class GraphCount(TrainerCallback):
    """Dynamo's compiled graphs in this process after each step (``counts``): constant once a
    compiled training step stops recompiling."""

    def __init__(self):
        self.counts: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        from .._upstream.torch import dynamo_graph_count

        self.counts.append(dynamo_graph_count())


def gkd_trainer(
    tmpdir: str, *, lmbda: float = 0.5, divergent_draws: bool = True, diverge_eos: bool = False, callbacks=()
):
    """``trl.experimental.gkd.GKDTrainer`` with a tiny teacher (8 new tokens, 2 steps).

    GKD draws ``random.random() <= lmbda`` on every rank independently in ``training_step``;
    ``divergent_draws=True`` adds :class:`DivergentDraws` so that only rank 0 generates at step 0.
    """
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    args = _args(GKDConfig, tmpdir, lmbda=lmbda, max_new_tokens=8)
    tok = tiny_tokenizer()
    model = _model(tok, script="eos" if diverge_eos else None)
    teacher = _model(tok, teacher=True, seed=1)
    callbacks = list(callbacks) + ([DivergentDraws(lmbda)] if divergent_draws else [])
    return GKDTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=_conversations(),
        processing_class=tok,
        callbacks=callbacks,
    )


def gold_trainer(tmpdir: str, *, lmbda: float = 1.0, diverge_eos: bool = False, callbacks=()):
    """``trl.experimental.gold.GOLDTrainer`` with a tiny teacher sharing the tokenizer.

    GOLD draws on rank 0 and broadcasts the on-policy flags, so ranks agree; ``lmbda`` defaults
    to 1.0 (TRL: 0.5) so that every step generates.
    """
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    args = _args(GOLDConfig, tmpdir, lmbda=lmbda, max_completion_length=8)
    tok = tiny_tokenizer()
    model = _model(tok, script="eos" if diverge_eos else None)
    teacher = _model(tok, teacher=True, seed=1)
    return GOLDTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=_conversations(),
        processing_class=tok,
        callbacks=list(callbacks),
    )


def distillation_trainer(
    tmpdir: str,
    *,
    gather: bool = True,
    tools: bool = False,
    diverge_eos: bool = False,
    evaluate: bool = False,
    callbacks=(),
):
    """``trl.DistillationTrainer`` (fully on-policy) with a tiny teacher; options as in
    :func:`grpo_trainer`."""
    from trl import DistillationConfig, DistillationTrainer

    # 4 eval prompts, batch 1: 2 eval batches a rank, the second generating inside the first's region
    evals = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=1) if evaluate else {}
    args = _args(
        DistillationConfig, tmpdir, max_completion_length=80 if tools else 16, ds3_gather_for_generation=gather, **evals
    )
    tok = tiny_tokenizer()
    model = _model(tok, script="tool" if tools else "eos" if diverge_eos else None)
    teacher = _model(tok, teacher=True, seed=1)
    return DistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=_prompts(),
        eval_dataset=_prompts(4) if evaluate else None,
        processing_class=tok,
        tools=[ping] if tools else None,
        callbacks=list(callbacks),
    )


def _result(trainer) -> dict:
    """After ``trainer.train()``: the losses, the full log history (GRPO and Distillation log
    ``completions/mean_length`` over all ranks) and this rank's ``generate()`` calls and the
    forwards they ran (in all, and per call)."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(trainer.model)
    stats = getattr(model, "generate_stats", None) or {"calls": 0, "forwards": 0, "per_call": []}
    logs = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in logs if "loss" in h],
        "logs": logs,
        "generate_calls": stats["calls"],
        "decode_forwards": stats["forwards"],
        "forwards_per_call": list(stats["per_call"]),
        "tokens": list(stats.get("tokens", ())),
        "loops": list(stats.get("loops", ())),
    }


def _train(build, *args, **kwargs) -> dict:
    from .launcher import mark

    mark(f"building {build.__name__}")
    trainer = build(*args, **kwargs)
    mark(f"training {build.__name__}")
    trainer.train()
    return _result(trainer)


def run_grpo(tmpdir: str, **kwargs) -> dict:
    """Rank function: :func:`grpo_trainer` ``(**kwargs)``, trained; see :func:`_result`."""
    return _train(grpo_trainer, tmpdir, **kwargs)


def run_gkd(tmpdir: str, **kwargs) -> dict:
    """Rank function for :func:`gkd_trainer`; also returns the step-0 draw when scripted."""
    from .launcher import mark

    mark("building gkd_trainer")
    trainer = gkd_trainer(tmpdir, **kwargs)
    draws = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DivergentDraws)]
    mark("training gkd_trainer")
    trainer.train()
    return {**_result(trainer), "first_draw": draws[0].first_draw if draws else None}


def run_gold(tmpdir: str, **kwargs) -> dict:
    """Rank function for :func:`gold_trainer`."""
    return _train(gold_trainer, tmpdir, **kwargs)


def run_distillation(tmpdir: str, **kwargs) -> dict:
    """Rank function for :func:`distillation_trainer`."""
    return _train(distillation_trainer, tmpdir, **kwargs)


def sdft_trainer(tmpdir: str, *, callbacks=()):
    """``trl.experimental.sdft.SDFTTrainer`` (self-distillation: the model is its own teacher on
    prompts that carry a privileged context), 2 prompts x 2 generations per step, 16 new tokens;
    ``teacher_model_kind="live"`` (TRL's ``"base"`` would load the teacher by the model's name,
    which a model built in code has not)."""
    from datasets import Dataset
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    args = _args(SDFTConfig, tmpdir, num_generations=2, max_completion_length=16, teacher_model_kind="live")
    tok = tiny_tokenizer()
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in _PROMPTS],
            "privileged_context": [f"The answer to '{p}' is short." for p in _PROMPTS],
        }
    )
    return SDFTTrainer(
        model=_model(tok), args=args, train_dataset=data, processing_class=tok, callbacks=list(callbacks)
    )


def sdpo_trainer(tmpdir: str, *, callbacks=()):
    """``trl.experimental.sdpo.SDPOTrainer`` (GRPO-style rollouts scored by :func:`length_reward`,
    the model its own teacher), 2 prompts x 2 generations per step, 16 new tokens;
    ``teacher_model_kind="live"`` (TRL's ``"ema"`` would load a teacher copy by the model's name)."""
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    args = _args(SDPOConfig, tmpdir, num_generations=2, max_completion_length=16, teacher_model_kind="live")
    tok = tiny_tokenizer()
    return SDPOTrainer(
        model=_model(tok),
        reward_funcs=length_reward,
        args=args,
        train_dataset=_prompts(),
        processing_class=tok,
        callbacks=list(callbacks),
    )
