"""Lockstep generation: every rank of a ZeRO-3 group runs the same number of decode forwards.

Under ZeRO-3 each forward all-gathers parameters, so a rank that leaves ``generate()`` early
(its sequences hit EOS first) leaves the others waiting in an all-gather forever. Transformers'
``synced_gpus`` avoids this only when it can see ZeRO-3, all-reduces over WORLD (which hangs when
a data-parallel subgroup generates alone) and does so every token.

Here the decoding loop of transformers (greedy, sampling, beam search) keeps running forwards on a
rank whose sequences are done (they get the pad token, the first EOS is kept), and the loop ends:

* ``stop="sync"``: once no rank of the parameters' own gather group has unfinished sequences,
  checked with one all-reduce every ``sync_every`` steps (so at most ``sync_every - 1`` extra
  forwards after the last rank's final EOS);
* ``stop="fixed"``: after exactly ``max_new_tokens`` steps, with no per-step collective.

``gather="auto"`` additionally gathers the whole model once per call when every rank has the
memory, so no collective runs per token at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from .. import _compat, agree, zero3
from ..gathering import GATHER_MODES, EvalGatherMixin, gathered_forwards

__all__ = ["LockstepConfig", "LockstepStats", "Zero3GenerationMixin", "lockstep",
           "lockstep_generate", "STOP_MODES"]

STOP_MODES = ("sync", "fixed")
_LOCKSTEP_KWARGS = ("stop", "sync_every", "gather", "group")


@dataclass
class LockstepConfig:
    """How a lockstep model generates.

    Attributes:
        stop: ``"sync"`` (stop together once every rank is done) or ``"fixed"`` (always
            ``max_new_tokens`` steps).
        sync_every: with ``stop="sync"``, steps between two agreement all-reduces.
        gather: ``"auto"`` (whole model once per call if every rank has the memory, else layer by
            layer), ``"all"`` or ``"layerwise"``.
        group: process group to agree over; default: the parameters' own gather group.
    """

    stop: str = "sync"
    sync_every: int = 1
    gather: str = "auto"
    group: Any = None

    def validate(self) -> "LockstepConfig":
        if self.stop not in STOP_MODES:
            raise ValueError(f"stop must be one of {STOP_MODES}, not {self.stop!r}")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every must be a positive int, not {self.sync_every!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, not {self.gather!r}")
        return self


@dataclass
class LockstepStats:
    """What the last lockstep ``generate()`` call did on this rank (same on every rank)."""

    forwards: int = 0          # decode forwards including the prefill
    steps_budget: int = 0      # agreed maximum number of steps
    agreements: int = 0        # all-reduces issued by the stop logic
    gather: str = "none"       # "all", "layerwise" or "none"
    extra_forwards: int = 0    # forwards run after this rank's own sequences were done
    stop: str = "sync"


@dataclass
class _LoopState:
    cfg: LockstepConfig
    group: Any
    device: torch.device
    stats: LockstepStats
    budget: int | None = None
    calls: int = 0
    done_at: int | None = None


class Zero3GenerationMixin:
    """A ``GenerationMixin`` refinement that generates in lockstep under ZeRO-3.

    Put it first in a model's bases (``class M(Zero3GenerationMixin, LlamaForCausalLM)``), or apply
    it to an existing instance with :func:`lockstep`. ``generate()`` takes the extra keyword
    arguments ``stop``, ``sync_every``, ``gather`` and ``group`` (see :class:`LockstepConfig`).
    Without ZeRO-3 or with one rank it is plain ``generate()``.
    """

    hf_zero3_lockstep_config: LockstepConfig = LockstepConfig()
    hf_zero3_last_generate: LockstepStats | None = None
    _hf_zero3_loop: _LoopState | None = None

    def generate(self, *args, **kwargs):
        overrides = {k: kwargs.pop(k) for k in _LOCKSTEP_KWARGS if k in kwargs}
        cfg = replace(self.hf_zero3_lockstep_config, **overrides).validate()
        if not zero3.is_zero3_model(self):
            return super().generate(*args, **kwargs)
        group = cfg.group if cfg.group is not None else zero3.gather_group(self)
        _check_group_matches(self, group)
        if zero3.group_world_size(group) == 1 and cfg.gather == "auto":
            return super().generate(*args, **kwargs)
        _compat.transformers_generation_hooks_present()
        _refuse_rank_divergent_options(cfg, kwargs)
        stats = LockstepStats(stop=cfg.stop)
        engine_or_self = zero3.engine_of(self) or self
        with gathered_forwards(engine_or_self, cfg.gather, group) as plan:
            stats.gather = plan.strategy
            self._hf_zero3_loop = _LoopState(cfg, group, agree.agreement_device(group), stats)
            try:
                kwargs["synced_gpus"] = True  # keep forwards going on a finished rank
                out = super().generate(*args, **kwargs)
            finally:
                self._hf_zero3_loop = None
        self.hf_zero3_last_generate = stats
        return out

    # -- transformers hooks (see _compat.transformers_generation_hooks_present) ---------------
    def _prepare_generated_length(self, generation_config=None, *args, **kwargs):
        generation_config = super()._prepare_generated_length(generation_config, *args, **kwargs)
        loop = self._hf_zero3_loop
        if loop is not None:
            input_len = kwargs["input_ids_length"] if "input_ids_length" in kwargs else args[3]
            loop.budget = int(generation_config.max_length) - int(input_len)
            if loop.budget < 1:
                raise ValueError(
                    f"max_length ({generation_config.max_length}) leaves no room to generate after "
                    f"the {input_len}-token input; use max_new_tokens")
        return generation_config

    def _has_unfinished_sequences(self, this_peer_finished, synced_gpus, device=None, **kwargs):
        loop = self._hf_zero3_loop
        if loop is None:
            return super()._has_unfinished_sequences(this_peer_finished, synced_gpus, device, **kwargs)
        # Call k comes before loop iteration k; iterations k >= 1 each run one forward, after
        # the prefill forward. So stopping at call K means K forwards in all.
        k = loop.calls
        loop.calls += 1
        stats = loop.stats
        if this_peer_finished and loop.done_at is None:
            loop.done_at = k
        if k == 0:
            # Agree on the step budget: ranks can differ (max_length with unequal prompts).
            budget = loop.budget if loop.budget is not None else 0
            hi, neg_lo = agree.all_max([budget, -budget], loop.group)
            stats.agreements += 1
            if loop.cfg.stop == "fixed" and hi != -neg_lo:
                raise ValueError(
                    f"stop='fixed' needs the same number of steps on every rank, but this group's "
                    f"ranks have between {-neg_lo} and {hi} (max_length with unequal prompt "
                    "lengths?); pass max_new_tokens, or use stop='sync'")
            loop.budget = stats.steps_budget = hi
            return True
        if k >= loop.budget:
            go = False  # every rank's budget is spent: known everywhere without a collective
        elif loop.cfg.stop == "fixed" or k % loop.cfg.sync_every != 0:
            go = True
        else:
            (unfinished,) = agree.all_max([0 if this_peer_finished else 1], loop.group)
            stats.agreements += 1
            go = unfinished == 1
        if not go:
            stats.forwards = k
            stats.extra_forwards = k - (loop.done_at if loop.done_at is not None else k)
        return go


def _check_group_matches(model, group) -> None:
    """A group that does not contain the parameters' gather group would agree on the wrong ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    own = zero3.gather_group(model)
    if group is own:
        return
    own_ranks, ranks = set(zero3.group_ranks(own)), set(zero3.group_ranks(group))
    if not own_ranks <= ranks:
        raise ValueError(
            f"group= has ranks {sorted(ranks)} but the model's parameters are gathered over ranks "
            f"{sorted(own_ranks)}; every rank that gathers must take part in the stop decision. "
            "Leave group=None to use the parameters' own group.")


def _refuse_rank_divergent_options(cfg: LockstepConfig, kwargs: dict) -> None:
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            "assisted decoding is not supported under lockstep generation: its finished ranks keep "
            "appending tokens and run the assistant a rank-dependent number of times")
    gen_cfg = kwargs.get("generation_config")
    max_time = kwargs.get("max_time", getattr(gen_cfg, "max_time", None))
    if max_time is not None and cfg.stop == "fixed":
        raise ValueError(
            "max_time cannot shorten stop='fixed' generation (it always runs max_new_tokens steps "
            "on every rank); use stop='sync', where each rank's clock only finishes its own "
            "sequences and the group stops together")


_LOCKSTEP_CLASSES: dict[type, type] = {}


def _lockstep_class(cls: type) -> type:
    if issubclass(cls, Zero3GenerationMixin):
        return cls
    if cls not in _LOCKSTEP_CLASSES:
        # EvalGatherMixin rides along: eval forwards of a compiled ZeRO-3 model need it too.
        # Same name as the library class: save_pretrained records it in config.architectures.
        _LOCKSTEP_CLASSES[cls] = type(cls.__name__, (Zero3GenerationMixin, EvalGatherMixin, cls),
                                      {"__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
    return _LOCKSTEP_CLASSES[cls]


def _generating_model(obj) -> nn.Module:
    """The module whose ``GenerationMixin`` methods run: through an engine and PEFT wrappers."""
    module = zero3.unwrap(obj)
    get_base = getattr(module, "get_base_model", None)  # PEFT
    if callable(get_base):
        module = get_base()
    if not hasattr(module, "_has_unfinished_sequences"):
        raise TypeError(f"{type(module).__name__} is not a transformers generation model "
                        "(no GenerationMixin)")
    return module


def lockstep(model, *, stop: str = "sync", sync_every: int = 1, gather: str = "auto",
             group=None):
    """Make ``model.generate()`` run in lockstep under ZeRO-3, in place (no weights reloaded).

    ``model`` may be a transformers model, a PEFT-wrapped one, or a DeepSpeed engine (its
    ``.module`` is changed). Returns ``model`` for chaining.
    """
    target = _generating_model(model)
    zero3.unwrap(model)  # remembers the engine of an engine's module
    target.__class__ = _lockstep_class(type(target))
    target.hf_zero3_lockstep_config = LockstepConfig(stop, sync_every, gather, group).validate()
    return model


def lockstep_generate(model, *, stop: str = "sync", sync_every: int = 1, gather: str = "auto",
                      group=None, **generate_kwargs):
    """``model.generate(**generate_kwargs)`` in lockstep, leaving ``model``'s class as it was.

    ``model`` may be a transformers model, a PEFT model or a DeepSpeed engine.
    """
    target = _generating_model(model)
    saved = target.__class__, target.__dict__.get("hf_zero3_lockstep_config")
    lockstep(model, stop=stop, sync_every=sync_every, gather=gather, group=group)
    try:
        return zero3.unwrap(model).generate(**generate_kwargs)
    finally:
        target.__class__ = saved[0]
        if saved[1] is None:
            target.__dict__.pop("hf_zero3_lockstep_config", None)
        else:
            target.hf_zero3_lockstep_config = saved[1]
