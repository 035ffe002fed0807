"""Lockstep generation: every rank of a ZeRO-3 group runs the same number of decode forwards.

Under ZeRO-3 each forward all-gathers parameters, so a rank that leaves ``generate()`` early
(its sequences hit EOS first) leaves the others waiting in an all-gather forever. Transformers'
``synced_gpus`` avoids this only when it can see ZeRO-3, all-reduces over WORLD (which hangs when
a data-parallel subgroup generates alone) and does so every token.

Here the decoding loop of transformers (greedy, sampling, beam search) keeps running forwards on a
rank whose sequences are done (they get the pad token, the first EOS is kept), and the loop ends:

* ``stop="sync"``: once no rank of the parameters' own gather group has unfinished sequences,
  checked with one agreement every ``sync_every`` steps (so at most ``sync_every - 1`` extra
  forwards after the last rank's final EOS). By default (``sync_every=None``) every step, and with
  compiled decoding every :data:`COMPILED_SYNC_EVERY` steps. Compiled decoding checks late, each
  check agreeing on what the previous check saw (:func:`stop_schedule`): the host agrees while the
  GPU decodes the next steps, so the agreement's latency, which grows with the group, stays off
  the decode's path (at most ``2 * sync_every - 1`` extra forwards);
* ``stop="fixed"``: after exactly ``max_new_tokens`` steps, with no per-step collective.

Every call is agree-or-raise (:mod:`hf_zero3.agree`): after transformers has validated the
arguments and before the first collective, the ranks agree on the options that must match
(``stop``, ``sync_every``, ``gather``), the call count and the step budget; a rank whose
validation failed enters that agreement with its error, and every rank raises it. An exception
later in the call is shared at the next agreement (the next stop check or the call's end).
``gather="auto"`` then gathers the whole model once per call when every rank has the memory.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .. import runtime, zero3
from .._upstream import deepspeed as ds_up
from .._upstream import transformers as hf_up
from .._upstream.versions import require
from ..decode import static_loop
from ..decode.features import DecodeReport
from ..decode.stops import LoopOutcome, StopAgreement, StopSchedule
from ..errors import RankDivergenceError, RankFailure
from ..gathering import EvalGatherMixin, gathered_forwards, region_facts
from ..options import DecodeOptions
from ..runtime import runtime_of
from . import compiled_decode
from .config import (
    LOCKSTEP_FIELDS,
    LockstepConfig,
    LockstepStats,
    lockstep_config,
    stop_schedule,
)


class _Call(StopAgreement):
    """One lockstep ``generate()`` call: its agreements, its gathered region, its loop counters;
    to the static loop, the :class:`~hf_zero3.decode.stops.StopAgreement` it decodes for."""

    def __init__(self, model: nn.Module, rt, cfg: LockstepConfig, group):
        self.model, self.rt, self.cfg, self.group = model, rt, cfg, group
        self.stats = LockstepStats(stop=cfg.stop, joined=rt.join is not None)
        self.budget: int | None = None
        self.calls = 0
        self.done_at: int | None = None
        self.phase = "validating"  # -> "encoding" (encoder-decoder) -> "decoding" -> "done"
        self.region = None
        self.compile = False  # compiled decode wanted (the region must still allow it)
        self.options: DecodeOptions | None = None  # resolved, where compiled decoding is wanted
        self.own_loop_only = False  # TRL's disable_compile: the static loop or eager, never transformers' compiled loop
        self.any_compile = False  # some rank of the group wants compiled decoding (agreed at the start)
        self.every, self.late = 1, False  # stop checks: spacing, on the previous check's flags (stop_schedule)
        self._seen_unfinished = True  # a late check's value: what the previous check saw

    def _agree(self, op: str, values=(), *, error=None, count=False, record=None, **extra) -> list[int]:
        self.stats.agreements += 1
        try:
            return self.rt.agree(
                op, values, error=error, count=count, record=record, group=self.group, **self.cfg.options(), **extra
            )
        except (RankFailure, RankDivergenceError):
            self.phase = "shared"  # every rank raises this one; nothing more to share
            raise

    def begin(self, error: BaseException | None = None, budget: int = 0) -> list[int]:
        """The call's first agreement, before its first collective: options, call count, failures
        (and, for a decoder-only model, the step budget), and what the gathered region decides on
        (who has the memory, who holds the parameters), and whether any rank wants compiled
        decoding (then every rank checks its stop late: :func:`stop_schedule`); then the region
        opens without an agreement of its own."""
        facts, need, facts_error = region_facts(self.model, self.cfg.gather)
        values = [budget, -budget, *facts, int(self.compile)]
        hi, neg_lo, *agreed_facts, any_compile = self._agree("generate", values, error=error or facts_error, count=True)
        self.any_compile = bool(any_compile)
        self.phase = "encoding"
        region = gathered_forwards(
            runtime.engine_of(self.model) or self.model,
            self.cfg.gather,
            self.group,
            op="generate.gather",
            agreed=(agreed_facts, need),
        )
        try:
            self.stats.gather = region.__enter__().strategy
        except (RankFailure, RankDivergenceError):
            self.phase = "shared"  # the region's own agreement shared it already
            raise
        self.region = region
        return [hi, neg_lo]

    def validated(self, error: BaseException | None = None) -> None:
        """Arguments fully checked (step budget known): agree the budget, then decode. A decoder-only
        call agrees once here (then its region decides how to gather); an encoder-decoder call agreed
        at the encoder and adds the budget's agreement here."""
        budget = self.budget if self.budget is not None else 0
        if self.phase == "validating":
            hi, neg_lo = self.begin(error, budget)
        else:
            hi, neg_lo = self._agree("generate.budget", [budget, -budget], error=error)
        if self.cfg.stop == "fixed" and hi != -neg_lo:
            self.phase = "shared"  # identical on every rank: the agreed numbers decide
            raise ValueError(
                f"stop='fixed' needs the same number of steps on every rank, but this group's "
                f"ranks have between {-neg_lo} and {hi} (max_length with unequal prompt "
                "lengths?); pass max_new_tokens, or use stop='sync'"
            )
        self.budget = self.stats.steps_budget = hi
        # the group's schedule, from agreed facts: a rank that decodes eagerly beside compiled ones
        # checks late with them
        compiled = self.any_compile and compiled_decode.region_allows(self.stats.gather)[0]
        self.every, self.late = stop_schedule(self.cfg.sync_every, compiled)
        self.stats.sync_every, self.stats.late_checks = self.every, self.late
        self.phase = "decoding"

    def fail(self, exc: BaseException) -> None:
        """This rank raised: hand the failure to the others at the agreement they wait in."""
        if self.phase in ("shared", "done"):
            return
        if self.phase == "validating":
            self.begin(exc)  # its agreement raises the shared failure; no region opens
        else:
            self._agree("generate.abort", error=exc)

    def end(self) -> None:
        f = self.stats.forwards
        hi, neg_lo = self._agree("generate.end", [f, -f], record=True)  # where a missing rank is named
        self.phase = "done"
        if hi != -neg_lo:
            raise RankDivergenceError(
                f"hf_zero3: ranks ran between {-neg_lo} and {hi} decode forwards in one "
                "lockstep generate() call; please report this"
            )

    def close(self) -> None:
        if self.region is not None:
            region, self.region = self.region, None
            region.__exit__(None, None, None)

    # -- the loop condition ---------------------------------------------------------------------
    def keep_going(self, this_peer_finished: bool) -> bool:
        # The k-th call (counting from 0) comes before loop iteration k; iteration k runs forward
        # k + 1 (the prefill is forward 1, before the first call). So stopping at the K-th call
        # means K forwards in all.
        k = self.calls
        self.calls += 1
        if self.rt.join is not None:
            this_peer_finished = True  # a joining rank's rows are placeholders
        if this_peer_finished and self.done_at is None:
            self.done_at = k
        if k == 0:
            return True
        if k >= self.budget:
            go = False  # every rank's budget is spent: known everywhere without a collective
        elif self.cfg.stop == "fixed" or k % self.every != 0:
            go = True
        else:
            go = self.agree_unfinished(not this_peer_finished)
        if not go:
            self.stats.forwards = k
            self.stats.extra_forwards = k - (self.done_at if self.done_at is not None else k)
        return go

    def agree_unfinished(self, unfinished: bool) -> bool:
        """The stop agreement: does any rank of the group still have unfinished rows? With late
        checks (:func:`stop_schedule`) it agrees on the value the previous check passed (the
        static loop passes its previous snapshot itself: :meth:`agree_step`)."""
        if self.late:
            unfinished, self._seen_unfinished = self._seen_unfinished, unfinished
        return self.agree_step(unfinished)

    def schedule(self) -> StopSchedule:
        """The schedule :meth:`validated` settled, for the static loop."""
        return StopSchedule(
            budget=int(self.budget),
            every=self.every,
            fixed=self.cfg.stop == "fixed",
            late=self.late,
            joined=self.rt.join is not None,
        )

    def agree_step(self, unfinished: bool) -> bool:
        """The stop agreement on ``unfinished`` as given (tagged with the check's schedule, which
        the call's first agreement made the group's)."""
        (any_unfinished,) = self._agree("generate.step", [1 if unfinished else 0], every=self.every, late=self.late)
        return any_unfinished == 1

    def finish_loop(self, outcome: LoopOutcome) -> None:
        """hf_zero3's static loop ran ``outcome.forwards`` forwards (see :mod:`.static_loop`)."""
        done_at = outcome.done_at
        if self.rt.join is not None:
            done_at = 0  # a joining rank's rows are placeholders, done from the start
        self.stats.forwards = outcome.forwards
        self.stats.extra_forwards = outcome.forwards - (done_at if done_at is not None else outcome.forwards)
        self.stats.loop = "hf_zero3"
        self.stats.graph_steps = outcome.graph_steps
        self.stats.graph_capture_s = outcome.capture_s
        self.stats.loop_reused = outcome.loop_reused
        self.stats.graphs_reused = outcome.graphs_reused
        self.stats.prefill, self.stats.prefill_reason = outcome.prefill, outcome.prefill_reason
        self.stats.decode_report = outcome.report if outcome.report is not None else DecodeReport()
        for why in self.stats.decode_report.fallbacks:  # a fenced function: the model's own code runs
            compiled_decode.say_once(f"the fast decode path keeps the model's own code: {why}", loud=outcome.compiled)
        if not outcome.compiled:
            self.stats.decode = "eager"
            self.stats.decode_reason = static_loop.failure(self.model)


class Zero3GenerationMixin:
    """A ``GenerationMixin`` refinement that generates in lockstep under ZeRO-3.

    Put it first in a model's bases (``class M(Zero3GenerationMixin, LlamaForCausalLM)``), or apply
    it to an existing instance with :func:`lockstep`. ``generate()`` also takes ``lockstep=`` (a
    :class:`LockstepConfig` for this call) and :class:`LockstepConfig`'s fields as keywords, over
    the stored settings.
    Without ZeRO-3 it is plain ``generate()``; with one rank nothing is exchanged, but the model is
    still gathered once per call (and DeepCompile's graph bypassed) instead of layer by layer.
    """

    @property
    def hf_zero3_last_generate(self) -> LockstepStats | None:
        """What the last lockstep ``generate()`` call did (None before the first)."""
        rt = runtime_of(self, create=False)
        return rt.last_generate if rt is not None else None

    def generate(self, *args, **kwargs):
        overrides = {k: kwargs.pop(k) for k in LOCKSTEP_FIELDS if k in kwargs}
        given = kwargs.pop("lockstep", None)
        if not zero3.is_zero3_model(self):
            return super().generate(*args, **kwargs)
        rt = runtime_of(self)
        error = None
        try:
            require("core")
            cfg = lockstep_config(given or rt.lockstep, **overrides).validate()
            group = cfg.group if cfg.group is not None else rt.group
            _check_group_matches(self, group)
            hf_up.generation_hooks_present()
            _refuse_rank_divergent_options(cfg, args, kwargs)
            want, why = compiled_decode.resolve(self, cfg.decode, kwargs, trl=rt.trl_trainer)
            own_only = want and compiled_decode.own_loop_only(self, cfg.decode, kwargs)
            options = (cfg.decode_options or DecodeOptions()).resolved()
            if want:
                compiled_decode.prepare(self, args, kwargs, cfg.bucket)
        except Exception as exc:  # shared at the call's first agreement: every rank raises it
            error, cfg, want, why, options, own_only = exc, LockstepConfig(), False, None, None, False
            group = overrides.get("group")  # None: the model's own group (a model with none raises alike)
        rt.enter()
        try:
            call = rt.loop = _Call(self, rt, cfg, group)
            call.compile, call.stats.decode_reason, call.options = want, why, options
            call.own_loop_only = own_only
            graphs = compiled_decode.graph_count()
            try:
                if error is not None:
                    call.begin(error)
                kwargs["synced_gpus"] = True  # keep forwards going on a finished rank
                out = super().generate(*args, **kwargs)
                call.end()
            except Exception as exc:  # (a KeyboardInterrupt is not shared, as in Zero3Safe's evaluate)
                call.fail(exc)
                raise
            finally:
                rt.loop = None
                call.close()
            call.stats.compiles = compiled_decode.graph_count() - graphs
            rt.last_generate = call.stats
            self.__dict__["hf_zero3_last_generate"] = call.stats  # the report outlives lockstep_generate's class swap
            return out
        finally:
            rt.leave()

    # -- transformers hooks (see hf_zero3._upstream.transformers.GENERATION_HOOKS) --------------
    def _maybe_prepare_encoder_kwargs_for_generation(self, *args, **kwargs):  # transformers >= 5.2x
        _encoder_begins(self)
        return super()._maybe_prepare_encoder_kwargs_for_generation(*args, **kwargs)

    def _prepare_encoder_decoder_kwargs_for_generation(self, *args, **kwargs):  # transformers <= 5.17
        _encoder_begins(self)
        return super()._prepare_encoder_decoder_kwargs_for_generation(*args, **kwargs)

    def _prepare_generated_length(self, generation_config=None, *args, **kwargs):
        generation_config = super()._prepare_generated_length(generation_config, *args, **kwargs)
        call = _call_of(self)
        if call is not None:
            input_len = hf_up.input_length_arg(args, kwargs)
            call.budget = int(generation_config.max_length) - input_len
            if call.budget < 1:
                raise ValueError(
                    f"max_length ({generation_config.max_length}) leaves no room to generate after "
                    f"the {input_len}-token input; use max_new_tokens"
                )
        return generation_config

    def _get_stopping_criteria(self, *args, **kwargs):
        criteria = super()._get_stopping_criteria(*args, **kwargs)  # transformers' last check
        call = _call_of(self)
        if call is not None:
            call.validated()
        return criteria

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
        call = _call_of(self)
        if call is None:
            return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        ok, why = compiled_decode.region_allows(call.stats.gather)
        if not call.compile:  # never over ZeRO-3's hooks, even with a StaticCache the user passed
            if call.cfg.decode == "eager" or not ok or call.own_loop_only:
                return False
            return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        broken = hf_up.contract_problems() if ok else ()
        if broken:  # a release that moved what the compiled path reads: never a silent fallback
            ok, why = False, broken[0]
        elif ok and not getattr(hf_up.generation_cache(model_kwargs), "is_compileable", False):
            ok, why = False, "the cache transformers prepared is not compileable"
        if not ok:
            call.stats.decode_reason = why
            compiled_decode.say_eager(why, loud=compiled_decode.loud_on(self, call.cfg.decode))
            return False
        call.stats.decode = "compiled"
        return True

    def _sample(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):  # hf_up.SAMPLE_HOOK
        call = _call_of(self)
        prologue = contextlib.nullcontext()
        if (
            call is not None
            and call.phase == "decoding"
            and call.compile
            and self._valid_auto_compile_criteria(model_kwargs, generation_config)
        ):
            # either loop's prompt forward would move each static layer's fill count with a host sync
            hf_up.static_cache_counters_on(hf_up.generation_cache(model_kwargs), input_ids.device)
            why = static_loop.unsupported(
                self,
                logits_processor,
                stopping_criteria,
                generation_config,
                streamer,
                model_kwargs,
                input_ids.shape[1] + int(call.budget),
            )
            if why is None:
                return static_loop.decode(
                    self,
                    call,
                    input_ids,
                    logits_processor,
                    stopping_criteria,
                    generation_config,
                    model_kwargs,
                    call.cfg.graph_steps,
                    call.options,
                )
            call.stats.loop_reason = why
            if call.own_loop_only:  # TRL's disable_compile: not transformers' compiled loop
                call.compile, call.stats.decode = False, "eager"
                call.stats.decode_reason = (
                    f"disable_compile=True ({call.rt.trl_trainer}) and not hf_zero3's loop: {why}"
                )
                compiled_decode.say_eager(call.stats.decode_reason, loud=compiled_decode.loud_on(self, "auto"))
            else:
                compiled_decode.say_once(
                    f"transformers' compiled loop instead of hf_zero3's static loop: {why}",
                    loud=compiled_decode.loud_on(self, "auto"),
                )
                # its compiled forward would trace DeepSpeed's forward prologue too (see
                # _upstream.deepspeed.engine_forward_hooks); the whole model is gathered, so it has nothing to do
                prologue = ds_up.engine_forward_hooks_suspended(self)
        with prologue:
            return super()._sample(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
            )

    def _has_unfinished_sequences(self, this_peer_finished, synced_gpus, device=None, **kwargs):
        call = _call_of(self)
        if call is None or call.phase != "decoding":
            return super()._has_unfinished_sequences(this_peer_finished, synced_gpus, device, **kwargs)
        return call.keep_going(this_peer_finished)


def _encoder_begins(model) -> None:
    """The encoder forward is the first collective of an encoder-decoder call: agree before it."""
    call = _call_of(model)
    if call is not None and call.phase == "validating" and model.config.is_encoder_decoder:
        call.begin()


def _call_of(model) -> _Call | None:
    rt = runtime_of(model, create=False)
    return rt.loop if rt is not None else None


def _check_group_matches(model, group) -> None:
    """A group that does not contain the parameters' gather group would agree on the wrong ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    own_ranks, ranks = zero3.gather_ranks(model), set(zero3.group_ranks(group))
    if not own_ranks <= ranks:
        raise ValueError(
            f"group= has ranks {sorted(ranks)} but the model's parameters are gathered over ranks "
            f"{sorted(own_ranks)}; every rank that gathers must take part in the stop decision. "
            "Leave group=None to use the parameters' own group."
        )


def _refuse_rank_divergent_options(cfg: LockstepConfig, args: tuple, kwargs: dict) -> None:
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            "assisted decoding is not supported under lockstep generation: its finished ranks keep "
            "appending tokens and run the assistant a rank-dependent number of times"
        )
    gen_cfg = kwargs.get("generation_config")
    max_time = kwargs.get("max_time", getattr(gen_cfg, "max_time", None))
    if max_time is not None and cfg.stop == "fixed":
        raise ValueError(
            "max_time cannot shorten stop='fixed' generation (it always runs max_new_tokens steps "
            "on every rank); use stop='sync', where each rank's clock only finishes its own "
            "sequences and the group stops together"
        )
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1 and inputs.shape[0] == 0:
        raise ValueError(
            "generate() got an empty batch (0 rows) on this rank; every rank of a ZeRO-3 group "
            "must generate at least one row (pad the batch, or skip generate() on every rank)"
        )


_LOCKSTEP_CLASSES: dict[type, type] = {}


def lockstep_class(cls: type, generation: bool = True) -> type:
    """``cls`` refined with EvalGatherMixin (always) and Zero3GenerationMixin (generation models).
    Same name as the library class: ``save_pretrained`` records it in ``config.architectures``."""
    mixins = ((Zero3GenerationMixin,) if generation else ()) + (EvalGatherMixin,)
    if all(issubclass(cls, m) for m in mixins):
        return cls
    key = (cls, generation)
    if key not in _LOCKSTEP_CLASSES:
        bases = tuple(m for m in mixins if not issubclass(cls, m)) + (cls,)
        _LOCKSTEP_CLASSES[key] = type(
            cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _LOCKSTEP_CLASSES[key]


def base_module(obj) -> nn.Module:
    """The module whose methods run: through an engine and PEFT wrappers."""
    module = runtime.unwrap(obj)
    get_base = getattr(module, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else module


def is_generation_model(module: nn.Module) -> bool:
    return hf_up.is_generation_model(module)


def _generating_model(obj) -> nn.Module:
    module = base_module(obj)
    if not is_generation_model(module):
        raise TypeError(f"{type(module).__name__} is not a transformers generation model (no GenerationMixin)")
    return module


def lockstep(model, lockstep: LockstepConfig | None = None, **options):
    """Make ``model.generate()`` run in lockstep under ZeRO-3, in place (no weights reloaded).

    ``model`` may be a transformers model, a PEFT-wrapped one, or a DeepSpeed engine (its
    ``.module`` is changed). ``lockstep``: a :class:`LockstepConfig`; ``options``: its fields as
    keywords, over it. Returns ``model`` for chaining. Local: nothing is exchanged until the next
    ``generate()``, whose first agreement checks every rank applied the same settings.
    """
    require("core")
    cfg = lockstep_config(lockstep, **options).validate()
    target = _generating_model(model)
    rt = runtime_of(model)
    target.__class__ = lockstep_class(type(target))
    rt.lockstep = cfg
    return model


def lockstep_generate(model, lockstep: LockstepConfig | None = None, **kwargs):
    """``model.generate(**kwargs)`` in lockstep, leaving ``model``'s class as it was.

    ``model`` may be a transformers model, a PEFT model or a DeepSpeed engine. ``lockstep``: a
    :class:`LockstepConfig`; keywords that name its fields go over it, the others to
    ``generate()``. The settings are checked inside the call, so a bad one on any rank makes every
    rank raise.
    """
    options = {k: kwargs.pop(k) for k in LOCKSTEP_FIELDS if k in kwargs}
    cfg = lockstep_config(lockstep, **options)
    target = _generating_model(model)
    saved = target.__class__
    target.__class__ = lockstep_class(saved)
    try:
        return runtime.unwrap(model).generate(**cfg.fields(), **kwargs)
    finally:
        target.__class__ = saved
