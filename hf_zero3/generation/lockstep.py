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
import torch.distributed as dist
import torch.nn as nn

from .. import runtime, zero3
from .._upstream import deepspeed as ds_up
from .._upstream import transformers as hf_up
from .._upstream.versions import require
from ..decode import plan as decode_plan
from ..decode import static_loop
from ..gathering import EvalGatherMixin
from ..options import DecodeOptions
from ..runtime import runtime_of
from . import compiled_decode
from .call import LockstepCall
from .config import (
    LOCKSTEP_FIELDS,
    LockstepConfig,
    LockstepStats,
    lockstep_config,
)


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
        return rt.generation.last if rt is not None else None

    def generate(self, *args, **kwargs):
        overrides = {k: kwargs.pop(k) for k in LOCKSTEP_FIELDS if k in kwargs}
        given = kwargs.pop("lockstep", None)
        if not zero3.is_zero3_model(self):
            return super().generate(*args, **kwargs)
        rt = runtime_of(self)
        error = None
        try:
            require("core")
            cfg = lockstep_config(given or rt.generation.config, **overrides).validate()
            group = cfg.group if cfg.group is not None else rt.group
            _check_group_matches(self, group)
            hf_up.generation_hooks_present()
            _refuse_rank_divergent_options(cfg, args, kwargs)
            request = decode_plan.DecodeRequest.of(self, cfg.decode, kwargs, trl=rt.trl.trainer)
            decided = decode_plan.plan(self, request)
            options = (cfg.decode_options or DecodeOptions()).resolved(rollout=rt.trl.trainer is not None)
            if decided.compiled:
                compiled_decode.prepare(self, args, kwargs, cfg.bucket)
            else:
                compiled_decode.say_eager(decided.step_reason, loud=compiled_decode.loud_on(self, cfg.decode))
        except Exception as exc:  # shared at the call's first agreement: every rank raises it
            error, cfg, options = exc, LockstepConfig(), None
            request, decided = decode_plan.DecodeRequest(mode="eager"), decode_plan.DecodePlan("eager")
            group = overrides.get("group")  # None: the model's own group (a model with none raises alike)
        rt.enter()
        try:
            call = rt.generation.call = LockstepCall(self, rt, cfg, group)
            call.request, call.options = request, options
            call.set_plan(decided)
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
                rt.generation.call = None
                call.close()
            call.stats.compiles = compiled_decode.graph_count() - graphs
            rt.generation.last = call.stats
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
        if not call.plan.compiled:  # never over ZeRO-3's hooks, even with a StaticCache the user passed
            if (
                call.request.mode == "eager"
                or call.request.own_loop_only
                or decode_plan.region_reason(call.stats.gather)
            ):
                return False
            return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        if call.plan.known == "loop":  # transformers' loop asks after _sample decided: compiled
            return True
        decided = decode_plan.plan(self, call.request, gather=call.stats.gather, model_kwargs=model_kwargs)
        call.set_plan(decided)
        if not decided.compiled:
            compiled_decode.say_eager(decided.step_reason, loud=compiled_decode.loud_on(self, call.cfg.decode))
            return False
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
            and call.plan.compiled
            and self._valid_auto_compile_criteria(model_kwargs, generation_config)
        ):
            length, cache = input_ids.shape[1] + int(call.budget), hf_up.generation_cache(model_kwargs)
            static_loop.ready_cache(self, cache, length, getattr(generation_config, "max_cache_len", None) or 0)
            # either loop's prompt forward would move each static layer's fill count with a host sync
            hf_up.static_cache_counters_on(cache, input_ids.device)
            # DeepCompile's next training forward would reset Dynamo and discard what compiles here:
            # its pending passes launch (and reset) now, before the loop compiles
            ds_up.launch_pending_compile_passes(call.rt.engine)
            inputs = decode_plan.LoopInputs(
                generation_config, model_kwargs, logits_processor, stopping_criteria, streamer, length
            )
            decided = decode_plan.plan(
                self, call.request, gather=call.stats.gather, model_kwargs=model_kwargs, loop=inputs
            )
            call.set_plan(decided)
            if decided.loop == "hf_zero3":
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
            if not decided.compiled:  # TRL's disable_compile: not transformers' compiled loop
                compiled_decode.say_eager(decided.step_reason, loud=compiled_decode.loud_on(self, "auto"))
            else:
                compiled_decode.say_once(
                    f"transformers' compiled loop instead of hf_zero3's static loop: {decided.loop_reason}",
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


def _call_of(model) -> LockstepCall | None:
    rt = runtime_of(model, create=False)
    return rt.generation.call if rt is not None else None


def _check_group_matches(model, group) -> None:
    """A group that does not contain the parameters' gather group would agree on the wrong ranks."""
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
    set_lockstep_config(model, cfg)  # attaches the runtime first: a model it refuses keeps its class
    target.__class__ = lockstep_class(type(target))
    return model


def set_lockstep_config(model, cfg: LockstepConfig) -> None:
    """``model``'s lockstep settings, which each ``generate()`` starts from (local)."""
    runtime_of(model).generation.config = cfg


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
