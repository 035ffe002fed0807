"""The lockstep options and the report of a call: :class:`LockstepConfig`, the one options object
every lockstep entry point takes, and :class:`LockstepStats`, what a call did."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..decode.plan import DECODE_MODES
from ..decode.stops import LoopStats
from ..gathering import GATHER_MODES
from ..options import DecodeOptions

STOP_MODES = ("sync", "fixed")
#: With compiled decoding and ``sync_every=None``: steps between two (late) stop checks, the
#: spacing with the least modelled overhead at 64 ranks (benchmarks/agreements, docs/concepts/agreements.md).
COMPILED_SYNC_EVERY = 2


@dataclass(kw_only=True)
class LockstepConfig:
    """How a lockstep model generates: the one options object of every lockstep entry point
    (:func:`lockstep`, :func:`lockstep_generate`, ``generate()``, ``Zero3Safe``,
    :func:`hf_zero3.trl.early_stop`), which take it as ``lockstep=`` or its fields as keywords.

    Attributes:
        stop: ``"sync"`` (stop together once every rank is done) or ``"fixed"`` (always
            ``max_new_tokens`` steps).
        sync_every: with ``stop="sync"``, steps between two agreements; None (default): every step,
            or with compiled decoding every :data:`COMPILED_SYNC_EVERY` steps (compiled decoding
            checks the previous check's flags: :func:`stop_schedule`).
        gather: ``"auto"`` (whole model once per call if every rank has the memory, else layer by
            layer), ``"all"`` or ``"layerwise"``.
        group: process group to agree over; default: the parameters' own gather group.
        decode: ``"auto"`` (default: a static KV cache and a compiled decode step when the
            whole model is gathered, on CUDA, unless the generation config says
            ``disable_compile`` outside a TRL rollout), ``"compiled"`` (the same, on any device,
            overriding it) or ``"eager"``; see :mod:`hf_zero3.generation.compiled_decode`.
        bucket: compiled decoding sizes its static cache to prompt + new tokens rounded up to
            this many tokens, so calls of other lengths in the bucket reuse the compiled step.
        graph_steps: compiled decoding on CUDA replays this many decode steps per CUDA-graph
            launch (between two stop agreements; 0: no CUDA graphs); None (default): 8 for a
            compiled step, 1 for an eager one (``DecodeOptions.compile_step=False``, TRL rollouts'
            default), whose capture costs the host every launch of each step it captures; see
            :mod:`hf_zero3.decode.static_loop`.
        decode_options: which parts of the compiled decode path to use
            (:class:`~hf_zero3.options.DecodeOptions`; None: every field from its ``HF_ZERO3_*``
            variable, else the measured best). Read inside each call, so a malformed variable on
            any rank makes every rank raise.
    """

    stop: str = "sync"
    sync_every: int | None = None
    gather: str = "auto"
    group: Any = None
    decode: str = "auto"
    bucket: int = 64
    graph_steps: int | None = None
    decode_options: DecodeOptions | None = None

    def validate(self) -> "LockstepConfig":
        if self.stop not in STOP_MODES:
            raise ValueError(f"stop must be one of {STOP_MODES}, not {self.stop!r}")
        if self.sync_every is not None and (
            isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1
        ):
            raise ValueError(f"sync_every must be a positive int or None (automatic), not {self.sync_every!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, not {self.gather!r}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, not {self.decode!r}")
        if isinstance(self.bucket, bool) or not isinstance(self.bucket, int) or self.bucket < 1:
            raise ValueError(f"bucket must be a positive int (tokens), not {self.bucket!r}")
        if self.graph_steps is not None and (
            isinstance(self.graph_steps, bool) or not isinstance(self.graph_steps, int) or self.graph_steps < 0
        ):
            raise ValueError(
                f"graph_steps must be an int >= 0 (decode steps per CUDA graph) or None, not {self.graph_steps!r}"
            )
        if self.decode_options is not None and not isinstance(self.decode_options, DecodeOptions):
            raise TypeError(f"decode_options must be a hf_zero3.DecodeOptions or None, not {self.decode_options!r}")
        return self

    def options(self) -> dict:
        """The settings every rank must share (they go into the call's agreement tag)."""
        return {"stop": self.stop, "sync_every": self.sync_every, "gather": self.gather}

    def fields(self) -> dict:
        """Every field by name (the objects themselves: a process group is not copied)."""
        return {name: getattr(self, name) for name in LOCKSTEP_FIELDS}


#: The names of :class:`LockstepConfig`'s fields: the keywords every lockstep entry point takes.
LOCKSTEP_FIELDS = tuple(f.name for f in fields(LockstepConfig))


def lockstep_config(lockstep: LockstepConfig | None = None, /, **options) -> LockstepConfig:
    """``lockstep`` (default: ``LockstepConfig()``) with ``options`` (field names) replacing its
    fields, unchecked; a name that is no field raises ``TypeError`` listing the fields."""
    if lockstep is not None and not isinstance(lockstep, LockstepConfig):
        raise TypeError(f"lockstep must be a hf_zero3.LockstepConfig or None, not {lockstep!r}")
    unknown = sorted(set(options) - set(LOCKSTEP_FIELDS))
    if unknown:
        raise TypeError(
            f"unknown lockstep option(s) {', '.join(unknown)}; LockstepConfig's fields are {', '.join(LOCKSTEP_FIELDS)}"
        )
    return replace(lockstep or LockstepConfig(), **options)


def stop_schedule(sync_every: int | None, compiled: bool) -> tuple[int, bool]:
    """(steps between stop checks, whether each check agrees on the previous check's flags).

    ``sync_every=None``: every step with transformers' eager loop (its host syncs every step
    anyway), every :data:`COMPILED_SYNC_EVERY` steps with compiled decoding (``compiled``: the call
    decodes compiled in a whole-model region). Compiled decoding checks late: each check agrees on
    the flags the previous check snapshotted, a device copy queued after the steps before it and
    read one check later, once those steps ran. The host never waits for the GPU at a check and
    agrees while the next steps decode, so the agreement's latency, which grows with the group,
    is hidden while it is shorter than ``sync_every`` steps. The group stops one window after the
    check that saw every row done; every rank decides on the same agreed values, so every rank
    runs the same forwards, and each rank's output still ends at its own last EOS."""
    if sync_every is None:
        sync_every = COMPILED_SYNC_EVERY if compiled else 1
    return sync_every, compiled


@dataclass
class LockstepStats(LoopStats):
    """What the last lockstep ``generate()`` call did on this rank (same on every rank): the
    call's own fields, and those of hf_zero3's static loop (:class:`~hf_zero3.decode.stops.LoopStats`,
    at their defaults where transformers' loop ran)."""

    forwards: int = 0  # decode forwards including the prefill
    steps_budget: int = 0  # agreed maximum number of steps
    agreements: int = 0  # the call's agreements (start, budget, stop checks, end; not the region's)
    gather: str = "none"  # "all", "layerwise", "held" or "none"
    extra_forwards: int = 0  # forwards run after this rank's own sequences were done
    stop: str = "sync"
    sync_every: int = 1  # steps between two stop checks (see stop_schedule)
    late_checks: bool = False  # each check agreed on the previous check's flags
    joined: bool = False  # this rank had no rows of its own (TRL call alignment)
    decode: str = "eager"  # "compiled": static KV cache + compiled decode step; "eager"
    decode_reason: str | None = None  # why the call decoded eagerly (None when compiled)
    compiles: int = 0  # Dynamo graphs compiled during the call (0: the compiled step was reused)
    loop: str = "transformers"  # whose decode loop ran: "transformers" or "hf_zero3" (static buffers)
    loop_reason: str | None = None  # why compiled decoding kept transformers' loop
