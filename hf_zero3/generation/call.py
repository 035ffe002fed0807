"""One lockstep ``generate()`` call: its agreements (start, budget, stop checks, end), its
gathered region and its counters; the :class:`~hf_zero3.decode.stops.StopAgreement` the static
loop decodes for. :class:`~hf_zero3.generation.lockstep.Zero3GenerationMixin` drives it."""

from __future__ import annotations

from dataclasses import fields

import torch.nn as nn

from .. import runtime
from ..decode import static_loop
from ..decode.plan import DecodePlan, DecodeRequest, region_reason
from ..decode.stops import LoopOutcome, LoopStats, StopAgreement, StopSchedule
from ..errors import RankDivergenceError, RankFailure
from ..gathering import gathered_forwards, region_facts
from ..options import DecodeOptions
from . import compiled_decode
from .config import (
    LockstepConfig,
    LockstepStats,
    stop_schedule,
)


class LockstepCall(StopAgreement):
    """One lockstep ``generate()`` call: its agreements, its gathered region, its loop counters;
    to the static loop, the :class:`~hf_zero3.decode.stops.StopAgreement` it decodes for."""

    def __init__(self, model: nn.Module, rt, cfg: LockstepConfig, group):
        self.model, self.rt, self.cfg, self.group = model, rt, cfg, group
        self.stats = LockstepStats(stop=cfg.stop, joined=rt.trl.join is not None)
        self.budget: int | None = None
        self.calls = 0
        self.done_at: int | None = None
        self.phase = "validating"  # -> "encoding" (encoder-decoder) -> "decoding" -> "done"
        self.region = None
        self.request = DecodeRequest(mode="eager")  # what the call asked that decides its decode path
        self.plan = DecodePlan("eager")  # the decode path as far as it is known (set_plan)
        self.options: DecodeOptions | None = None  # resolved, where compiled decoding is wanted
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
        values = [budget, -budget, *facts, int(self.plan.compiled)]
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
        compiled = self.any_compile and region_reason(self.stats.gather) is None
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
        if self.rt.trl.join is not None:
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
            self._count_forwards(k, self.done_at)
        return go

    def _count_forwards(self, forwards: int, done_at: int | None) -> None:
        """The call ran ``forwards`` forwards; this rank's rows were all done after ``done_at`` of
        them (None: never), so the rest kept the group in step."""
        self.stats.forwards = forwards
        self.stats.extra_forwards = forwards - (done_at if done_at is not None else forwards)

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
            joined=self.rt.trl.join is not None,
        )

    def agree_step(self, unfinished: bool) -> bool:
        """The stop agreement on ``unfinished`` as given (tagged with the check's schedule, which
        the call's first agreement made the group's)."""
        (any_unfinished,) = self._agree("generate.step", [1 if unfinished else 0], every=self.every, late=self.late)
        return any_unfinished == 1

    def set_plan(self, plan: DecodePlan) -> None:
        """The decode path as far as it is known (:func:`hf_zero3.decode.plan.plan`), into the
        report: its reasons as they are; compiled once the cache transformers prepared allows it."""
        self.plan = plan
        self.stats.decode_reason, self.stats.loop_reason = plan.step_reason, plan.loop_reason
        if plan.compiled and plan.known in ("cache", "loop"):
            self.stats.decode = "compiled"
        elif not plan.compiled:
            self.stats.decode = "eager"

    def finish_loop(self, outcome: LoopOutcome) -> None:
        """hf_zero3's static loop ran ``outcome.forwards`` forwards (see :mod:`.static_loop`)."""
        done_at = outcome.done_at
        if self.rt.trl.join is not None:
            done_at = 0  # a joining rank's rows are placeholders, done from the start
        self._count_forwards(outcome.forwards, done_at)
        self.stats.loop = "hf_zero3"
        for f in fields(LoopStats):  # the report extends the loop's stats: each one as it is
            setattr(self.stats, f.name, getattr(outcome.stats, f.name))
        for why in self.stats.decode_report.fallbacks:  # a fenced function: the model's own code runs
            compiled_decode.say_once(f"the fast decode path keeps the model's own code: {why}", loud=outcome.compiled)
        if not outcome.compiled:
            self.stats.decode = "eager"
            self.stats.decode_reason = static_loop.failure(self.model)
