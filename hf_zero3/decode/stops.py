"""What the static loop needs from the lockstep call it decodes for (:class:`StopAgreement`): the
group's stop schedule, one stop agreement at a time, and where the loop's outcome goes. Lockstep's
call implements it (:class:`hf_zero3.generation.call.LockstepCall`); the loop reads nothing else of lockstep,
and agrees nothing on its own."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class LoopOutcome:
    """What one call's static loop did, for the call's report (``hf_zero3_last_generate``)."""

    forwards: int  # forwards run, the prompt's included (the same on every rank)
    done_at: int | None  # the step this rank's rows were all done at (None: they ran to the end)
    compiled: bool  # False: the step's forward did not compile (the steps ran eagerly, uncaptured)
    graph_steps: int  # decode steps per CUDA-graph launch (0: no CUDA graphs)
    capture_s: float = 0.0  # host seconds spent capturing CUDA graphs
    loop_reused: bool = False  # the static buffers came from an earlier call
    graphs_reused: bool = False  # replayed CUDA graphs an earlier call captured
    prefill: str | None = None  # the prompt's forward: "compiled", "layers" or "eager"
    prefill_reason: str | None = None  # why it ran eagerly (None: compiled, or not asked to compile)
    step: str | None = None  # the decode steps' forward: "compiled", "layers" or "eager"
    report: DecodeReport | None = None  # the parts the steps computed their own way


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
