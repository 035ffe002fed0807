"""What the static loop needs from the lockstep call it decodes for (:class:`StopAgreement`): the
group's stop schedule, one stop agreement at a time, and where the loop's outcome goes. Lockstep's
call implements it (:class:`hf_zero3.generation.call.LockstepCall`); the loop reads nothing else of lockstep,
and agrees nothing on its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .features import DecodeReport


@dataclass(frozen=True)
class StopSchedule:
    """When the group agrees to stop, settled before the loop starts
    (:func:`hf_zero3.generation.config.stop_schedule`)."""

    budget: int  # the group's agreed step budget: forwards, the prompt's included
    every: int  # steps between two stop agreements
    fixed: bool  # stop="fixed": no agreement, every rank runs the budget
    late: bool  # each agreement is on the previous check's flags (a device snapshot read one check late)
    joined: bool  # this rank's rows are placeholders: it never keeps the group going


@dataclass
class LoopStats:
    """What hf_zero3's static loop did in a call: the loop's part of the call's report
    (:class:`hf_zero3.generation.config.LockstepStats` extends it, so a statistic added here
    reaches ``hf_zero3_last_generate`` as it is)."""

    graph_steps: int = 0  # decode steps per CUDA-graph launch (0: no CUDA graphs)
    graph_capture_s: float = 0.0  # host seconds the call spent capturing its CUDA graphs
    graph_reason: str | None = None  # why the steps were not captured as CUDA graphs (None: they were, or not asked)
    loop_reused: bool = False  # the static loop's buffers came from an earlier call (see hf_zero3.decode.static_loop)
    graphs_reused: bool = False  # replayed CUDA graphs an earlier call captured (same parameters, cache, state)
    graphs_moved: tuple[str, ...] = ()  # what the kept graphs read that this call held elsewhere, so it captured anew
    prefill: str | None = None  # the static loop's prompt forward: "compiled", "layers" or "eager" (None: not its loop)
    prefill_reason: str | None = None  # why it ran eagerly (None: compiled, or compile_prefill=False)
    step: str | None = None  # the static loop's decode steps: "compiled", "layers" or "eager" (None: not its loop)
    decode_report: DecodeReport = field(default_factory=DecodeReport)  # the parts the static loop computed its way


@dataclass(frozen=True)
class LoopOutcome:
    """How one call's static loop ended, for the call (:meth:`StopAgreement.finish_loop`)."""

    forwards: int  # forwards run, the prompt's included (the same on every rank)
    done_at: int | None  # the step this rank's rows were all done at (None: they ran to the end)
    compiled: bool  # False: the step's forward did not compile (the steps ran eagerly, uncaptured)
    stats: LoopStats  # what the loop did, for the call's report


class StopAgreement(Protocol):
    """The lockstep call the static loop decodes for."""

    def schedule(self) -> StopSchedule:
        """The group's stop schedule for this call."""
        ...

    def agree_step(self, unfinished: bool) -> bool:
        """One stop agreement: whether any rank of the group goes on (``unfinished``: this rank's
        value, as the schedule has it: with late checks, the previous check's)."""
        ...

    def finish_loop(self, outcome: LoopOutcome) -> None:
        """The loop ended: record ``outcome`` in the call's report."""
        ...
