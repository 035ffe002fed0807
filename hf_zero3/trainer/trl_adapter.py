"""Make TRL's trainers collective where they are not: every rank generates the same number of times.

Under ZeRO-3 every generation round is a collective (TRL's ``GatheredParameters`` gather, or the
per-layer gathers with ``ds3_gather_for_generation=False``). TRL lets the number of rounds depend
on the rank in three places; :func:`adapt` (applied by ``Zero3Safe`` and :func:`hf_zero3.trl.apply`)
makes each one collective on the trainer instance:

* **Tool loops** (GRPO, ``DistillationTrainer``): a rank regenerates only while its own completions
  call tools. Each round of the loop is now announced in an agreement; a rank whose loop ended
  *joins* the remaining rounds with a one-row placeholder generation whose rows count as finished
  (so it never extends the group's decoding), until the group agrees that no rank has a round
  left, in the spirit of DDP's ``Join``.
* **Per-rank draws** (GKD's ``random.random() <= lmbda``): the group takes the draw of its first
  rank, as TRL's GOLD and IW-OPD do by broadcast; each rank's ``random`` stream advances as before.
* **Uneven prompt splits** (``LogCompletionsCallback``, ``WeaveCallback``): each rank's prompts are
  padded to the group's largest count before generating; the padding's completions are dropped.

Under DeepCompile (DeepSpeed config ``compile.deepcompile`` and ``torch_compile=True``), TRL's fused
LM head on the policy model is replaced by a logits-based one that DeepCompile can compile with the
backbone (:mod:`hf_zero3.trainer.trl_fused_head`).

Three behaviours are patched process-wide (undone by ``hf_zero3.unpatch()``):

* after a gathered generation TRL's ``add_hooks`` re-registers DeepSpeed's eager ZeRO-3 hooks on
  the engine, which DeepCompile had removed; the compiled training graph then meets parameters the
  eager hooks hold ("Cannot free a ZeRO-3 parameter while it is still active in submodules"). On
  an engine whose DeepCompile is active the re-registration is skipped;
* TRL's gathering context for generation: inside ``evaluate`` (GRPO and the distillation trainers
  generate for each eval batch) it would gather the whole model while ``Zero3Safe``'s eval region
  still holds it ("Nested GatheredParameters contexts cannot overlap parameters"), so the region is
  released first;
* transformers' ``enable_input_require_grads`` replaces the hooks of its previous call instead of
  adding more: TRL disables and re-enables checkpointing around each rollout and log-prob pass, and
  transformers' disable leaves the hook, so hooks piled up two a step and a compiled training step
  recompiled every step (:mod:`hf_zero3._upstream.transformers`).

Under DeepCompile a trainer with TRL's ``pad_to_multiple_of`` (GRPO, RLOO, DistillationTrainer)
left at ``None`` pads prompts and completions to a multiple of
:data:`DEEPCOMPILE_PAD_TO_MULTIPLE_OF` (TRL does the same on Neuron; ``pad_to_multiple_of=1``
turns it off): on a GPU each new sequence length compiled a new static DeepCompile graph (a
profile and a compile, ~30 s, up to Dynamo's recompile limit; ``TORCH_LOGS=recompiles``). And the
tensors it pads after generation take the gather group's longest length (:func:`align_lengths`):
DeepCompile profiles a new graph with collectives, so ranks meeting new shapes at different steps
would hang (DeepSpeed issue #7611).

Generation itself goes through lockstep generation (installed by ``Zero3Safe``): when TRL already
holds the whole model gathered, the call uses it as it is (no second gather) and still stops with
the group's agreed early stop; with ``decode="auto"`` on CUDA it decodes through hf_zero3's static
loop although TRL's generation config says ``disable_compile`` (that setting keeps transformers'
own compiled loop off, and still does). A failure inside a round is shared with every rank.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import random

import torch.distributed as dist

from .. import zero3
from .._upstream import deepspeed as ds_up
from .._upstream import patches
from .._upstream import transformers as hf_up
from .._upstream import trl as trl_up
from .._upstream.transformers_trainer import trainer_deepspeed_config
from .._upstream.versions import require
from ..errors import Zero3Error
from ..gathering import close_eval_region
from ..runtime import runtime_of
from .trl_fused_head import replace_fused_head

log = logging.getLogger("hf_zero3.trl")
_DRAW_SCALE = 2**53
#: The runtime whose group agrees padded lengths while a trainer turns its completions into tensors.
_ALIGNING = contextvars.ContextVar("hf_zero3_trl_aligning", default=None)
#: Under DeepCompile, the padding multiple for a TRL trainer left at ``pad_to_multiple_of=None``.
DEEPCOMPILE_PAD_TO_MULTIPLE_OF = 128  # TRL's own choice on Neuron: fewer shapes than 64 (prompt x completion buckets)


def runs_zero3(trainer) -> bool:
    """Whether ``trainer``'s DeepSpeed config is ZeRO-3 (a trainer that is not is left alone)."""
    stage = ((trainer_deepspeed_config(trainer) or {}).get("zero_optimization") or {}).get("stage")
    if stage != 3:
        log.info("hf_zero3.trl: %s does not run ZeRO-3; nothing to adapt", type(trainer).__name__)
    return stage == 3


def adapt(trainer) -> list[str]:
    """Adapt ``trainer`` (a TRL trainer under ZeRO-3, served by a ``Zero3Safe``); returns the names
    of what was adapted. Local: nothing is exchanged until the first adapted call. Tool rounds of a
    vLLM trainer are left as they are (vLLM generates outside the ZeRO-3 group)."""
    require("trl")
    adapted = []
    patches.install(
        "trl.models.utils.add_hooks: not on DeepCompile engines",
        lambda: trl_up.wrap_module_function(trl_up.ADD_HOOKS, _skip_on_deepcompile),
    )
    patches.install(
        "trl.models.utils._unwrap_model_for_generation: release the eval region first",
        lambda: trl_up.wrap_module_function(trl_up.UNWRAP_FOR_GENERATION, _release_eval_region),
    )
    patches.install(
        "transformers.PreTrainedModel.enable_input_require_grads: replace, not add",
        hf_up.replace_input_grad_hooks_on_enable,
    )
    trainer._hf_zero3_trl_adapted = True  # Zero3Safe.on_train_begin calls before_training
    # TRL's disable_compile keeps transformers from compiling; hf_zero3's static loop still may
    # (see hf_zero3.generation.compiled_decode)
    _runtime(trainer).trl.trainer = type(trainer).__name__
    if _deepcompile_training(trainer):
        before_training(trainer)  # apply() after construction; else TRL adds its head later in __init__
        adapted.append("fused_lm_head")
    if trl_up.has_tool_loop(trainer):
        _align_tool_loop(trainer)
        adapted.append("tool_loop")
    if trl_up.per_rank_draw_trainer(trainer):
        _agree_draws(trainer)
        adapted.append("draws")
    # completion-logging callbacks are added after the trainer exists (they take it as an argument)
    patches.install(
        "trl.trainer.callbacks._generate_completions: even split",
        lambda: trl_up.wrap_module_function(trl_up.GENERATE_COMPLETIONS, _evenly_split),
    )
    adapted.append("completion_logging")
    log.info("hf_zero3.trl: %s adapted: %s", type(trainer).__name__, ", ".join(adapted) or "generation only")
    return adapted


def before_training(trainer) -> bool:
    """Called when training begins (``Zero3Safe.on_train_begin``), before the first compiled
    forward: under DeepCompile, TRL's fused LM head on the policy is swapped for the logits-based
    one (GRPO installs its head after ``Trainer.__init__`` ends, so not earlier). Local."""
    if not _deepcompile_training(trainer):
        return False

    align_lengths(trainer)
    if getattr(trainer, trl_up.PAD_TO_MULTIPLE_OF, False) is None:
        setattr(trainer, trl_up.PAD_TO_MULTIPLE_OF, DEEPCOMPILE_PAD_TO_MULTIPLE_OF)
        log.info(
            "hf_zero3.trl: DeepCompile compiles one graph per sequence length: %s pads prompts and completions "
            "to a multiple of %d (set pad_to_multiple_of in its config to choose; 1 = no padding)",
            type(trainer).__name__,
            DEEPCOMPILE_PAD_TO_MULTIPLE_OF,
        )
    return replace_fused_head(trainer.model)


def align_lengths(trainer) -> bool:
    """Pad what ``trainer`` turns its completions into (prompt and completion ids, masks) to the
    longest of the gather group, not of this rank: DeepCompile profiles each new graph with
    collectives, so ranks that meet a new sequence length at different steps hang (DeepSpeed issue
    #7611); with equal lengths every rank compiles the same graphs at the same step. One host
    agreement per padded tensor (4-6 a step). Installed under DeepCompile training; local until the
    first step. Returns False for a trainer without TRL's generate-then-pad steps."""
    score, generate = getattr(trainer, trl_up.SCORE_COMPLETIONS, None), getattr(trainer, trl_up.GENERATE, None)
    if score is None or generate is None:
        return False
    for module in trl_up.PAD_USERS:  # again after an unpatch(): the instance wrappers outlive it
        patches.install(
            f"{module}.pad: the group's length while aligning",
            functools.partial(trl_up.wrap_module_function, (module, "pad"), _padded_to_group),
        )
    if getattr(score, "_hf_zero3", False):
        return True

    scored = _aligning_during(score, lambda: _runtime(trainer) if _is_zero3(trainer) else None)
    scored._hf_zero3 = True
    setattr(trainer, trl_up.SCORE_COMPLETIONS, scored)
    # generation pads its prompts for itself: left alone
    setattr(trainer, trl_up.GENERATE, _aligning_during(generate, lambda: None))
    return True


def _aligning_during(fn, runtime):
    """``fn`` with :data:`_ALIGNING` set to ``runtime()`` while it runs (restored after)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = _ALIGNING.set(runtime())
        try:
            return fn(*args, **kwargs)
        finally:
            _ALIGNING.reset(token)

    return wrapped


def _padded_to_group(pad):
    """TRL's ``pad``, then, inside an aligning trainer's scoring step, extended (on the padding side,
    with the padding value) to the longest length over the group."""

    @functools.wraps(pad)
    def wrapped(tensors, padding_value=0, padding_side="right", pad_to_multiple_of=None):
        out = pad(tensors, padding_value, padding_side, pad_to_multiple_of)
        rt = _ALIGNING.get()
        if rt is None or out.dim() < 2:
            return out
        (longest,) = rt.agree("trl.pad_length", [out.shape[1]], record=False, side=padding_side)
        if longest == out.shape[1]:
            return out
        grown = out.new_full((out.shape[0], longest, *out.shape[2:]), padding_value)
        if padding_side == "left":
            grown[:, longest - out.shape[1] :] = out
        else:
            grown[:, : out.shape[1]] = out
        return grown

    return wrapped


def _deepcompile_training(trainer) -> bool:
    """The trainer will train through DeepCompile: its DeepSpeed config enables it and
    ``torch_compile`` makes accelerate call ``engine.compile()`` (the engine does not exist yet)."""
    config = trainer_deepspeed_config(trainer) or {}
    return bool((config.get("compile") or {}).get("deepcompile")) and bool(
        getattr(trainer.args, "torch_compile", False)
    )


def _runtime(trainer):
    engine = getattr(trainer, "model_wrapped", None)
    return runtime_of(engine if engine is not None and engine is not trainer.model else trainer.model)


def _is_zero3(trainer) -> bool:
    return zero3.is_zero3_model(trainer.model) and zero3.group_world_size(_runtime(trainer).group) > 1


class _Rounds:
    """A loop of collective rounds made collective (see the module docstring)."""

    def __init__(self, rt, op: str):
        self.rt, self.op = rt, op

    def announce(self) -> None:
        """This rank runs a round: the others run one with it (really or as a placeholder)."""
        self.rt.agree(self.op, [1])

    def join(self, placeholder) -> int:
        """This rank's rounds are over: run placeholders while another rank still has rounds."""
        joined = 0
        while self.rt.agree(self.op, [0])[0]:
            self.rt.trl.join = self.op
            try:
                placeholder()
            finally:
                self.rt.trl.join = None
            joined += 1
        return joined

    def fail(self, exc: BaseException) -> None:
        self.rt.agree(self.op, [0], error=exc)  # raises the shared failure on every rank


def _align_tool_loop(trainer) -> None:
    """Wrap this trainer's ``_tool_call_loop`` / ``_generate_single_turn`` (instance attributes)."""
    loop, single = getattr(trainer, trl_up.TOOL_LOOP), getattr(trainer, trl_up.SINGLE_TURN)
    if getattr(loop, "_hf_zero3", False):
        return
    state = {"rounds": None}

    @functools.wraps(single)
    def single_turn(*args, **kwargs):
        rounds = state["rounds"]
        if rounds is not None:
            rounds.announce()
        return single(*args, **kwargs)

    @functools.wraps(loop)
    def tool_loop(*args, **kwargs):
        if not _is_zero3(trainer) or trl_up.uses_vllm(trainer):  # vLLM generates outside the ZeRO-3 group
            return loop(*args, **kwargs)
        rounds = _Rounds(_runtime(trainer), "trl.tool_round")
        state["rounds"] = rounds
        try:
            result = loop(*args, **kwargs)
        except Exception as exc:
            state["rounds"] = None
            if not isinstance(exc, Zero3Error):
                rounds.fail(exc)
            raise
        state["rounds"] = None
        p_args, p_kwargs = trl_up.single_turn_placeholder_args(trainer, trl_up.tokenizer_of(trainer).eos_token_id)
        rounds.join(lambda: single(*p_args, **p_kwargs))
        return result

    tool_loop._hf_zero3 = True
    setattr(trainer, trl_up.SINGLE_TURN, single_turn)
    setattr(trainer, trl_up.TOOL_LOOP, tool_loop)


def _agree_draws(trainer) -> None:
    """GKD: one draw per step for the whole group (its first rank's), on this instance."""
    step = trainer.training_step
    if getattr(step, "_hf_zero3", False):
        return

    @functools.wraps(step)
    def training_step(*args, **kwargs):
        if not _is_zero3(trainer):
            return step(*args, **kwargs)
        rt = _runtime(trainer)
        saved_state = random.getstate()
        mine = random.random()  # the draw TRL is about to make here; the stream is rewound below
        random.setstate(saved_state)
        first = zero3.group_ranks(rt.group)[0]
        (agreed,) = rt.agree("trl.gkd.draw", [int(mine * _DRAW_SCALE) if dist.get_rank() == first else -1])
        lmbda = trainer.lmbda
        trainer.lmbda = 1.0 if agreed / _DRAW_SCALE <= lmbda else -1.0  # TRL's own draw now decides alike
        try:
            return step(*args, **kwargs)
        finally:
            trainer.lmbda = lmbda

    training_step._hf_zero3 = True
    trainer.training_step = training_step


def _skip_on_deepcompile(add_hooks):
    """TRL's ``add_hooks(engine)``, except on DeepCompile engines (whose graph gathers natively)."""

    @functools.wraps(add_hooks)
    def wrapped(model):
        if ds_up.is_engine(model) and ds_up.deepcompile_active(model):
            return None
        return add_hooks(model)

    return wrapped


def _release_eval_region(unwrap):
    """TRL's gathering context for generation (``_unwrap_model_for_generation``), after releasing
    an eval region ``Zero3Safe`` holds open on the model: TRL's GRPO and distillation trainers
    generate inside ``evaluate``, between eval forwards, and DeepSpeed refuses a
    ``GatheredParameters`` over parameters another one still holds. Local; the next eval forward
    gathers again, on every rank alike."""

    @functools.wraps(unwrap)
    def wrapped(model, accelerator, *args, **kwargs):
        if kwargs.get("gather_deepspeed3_params", args[0] if args else True):
            close_eval_region(model)
        return unwrap(model, accelerator, *args, **kwargs)

    return wrapped


def _evenly_split(generate_completions):
    """TRL's ``_generate_completions`` with each rank's prompts padded to the group's largest count."""

    @functools.wraps(generate_completions)
    def wrapped(prompts, model, tokenizer, *args, **kwargs):
        if not zero3.is_zero3_model(model):
            return generate_completions(prompts, model, tokenizer, *args, **kwargs)
        rt = runtime_of(model)
        n = len(prompts)
        (most,) = rt.agree("trl.log_completions", [n])
        filler = prompts[-1] if n else (tokenizer.eos_token or " ")
        out = generate_completions(list(prompts) + [filler] * (most - n), model, tokenizer, *args, **kwargs)
        return out[:n]

    return wrapped
