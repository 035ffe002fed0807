"""Rank agreement: every "decide, then act" in hf_zero3 decides here, over one group.

A ZeRO-3 group stays correct only while all its ranks issue the same collectives in the same
order. Every choice that changes the collectives (stop generating? gather the whole model? skip a
prefetch?) is reduced across the group first, and every agreement is *tagged* and *agree-or-raise*:

* one fixed-size all-reduce (``3 + SMALL`` integers) carries a 56-bit digest of the header
  (operation, the options that must match, the model, its count of collective calls, the
  payload's size), a failure flag and up to ``SMALL`` values. Its size is the same for every
  operation, so two ranks in different hf_zero3 operations pair up and see the difference
  instead of deadlocking or exchanging garbage;
* a rank that failed locally (bad argument, refused option, an exception mid-call) enters the
  agreement with its failure instead of leaving the others waiting; then every rank raises the
  same :class:`~hf_zero3.errors.RankFailure` naming the failing rank(s) and their messages;
* a header that differs raises :class:`~hf_zero3.errors.RankDivergenceError` on every rank, saying
  what differed on which rank (a second, fixed-size all-gather runs only on these error paths);
* agreements run over a gloo mirror of the group (:func:`host_group`): a host number is reduced
  on the host (no GPU stall), and hf_zero3's agreements never pair with a DeepSpeed or user
  collective on the group itself. A rank that never arrives is reported, with where every rank
  last agreed (recorded in the c10d store at call-level agreements), after
  ``HF_ZERO3_AGREE_TIMEOUT`` seconds (default: the group's own timeout).

What cannot be detected: an extra call on one rank that the other ranks' *next* call of the same
operation with the same options and counter pairs up with (data differs legitimately between
ranks, so nothing else tells the calls apart); the next agreement of another kind exposes it
(``Zero3Safe`` agrees once per training step, tagged with the Trainer's step), the timeout at the
end of the run.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ._upstream.torch import default_store, group_timeout
from .errors import RankDivergenceError, RankFailure, builtin_base, rank_failure_type

MAGIC = 0x687A33  # "hz3"
PROTOCOL = 1
# values carried in the fixed-size all-reduce (a generate() call's first: its budget, its region's
# facts and whether a rank decodes compiled); more go in a second one
SMALL = 7
DETAIL_BYTES = 4096  # per rank, error paths only
ERROR_CHARS = 1500  # of a failing rank's message: the tag and the error type always fit
TIMEOUT_ENV = "HF_ZERO3_AGREE_TIMEOUT"

_HOST_GROUPS: dict[tuple, Any] = {}
_HOST_LOCK = threading.Lock()


@dataclass(frozen=True)
class Tag:
    """What an agreement is about. ``op``, ``options`` and ``counter`` (the model's count of
    collective calls) must be equal on every rank."""

    op: str
    options: dict = field(default_factory=dict)
    counter: int = 0

    def digest(self, n_values: int, big: int) -> int:
        """56 bits over everything that must be equal on every rank (also the payload's size)."""
        text = f"{MAGIC}|{PROTOCOL}|{self.op}|{self.counter}|{_canonical(self.options)}|{n_values}|{big}"
        return _hash56(text)

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        return f"'{self.op}' (call {self.counter}{', ' + opts if opts else ''})"

    def to_json(self) -> dict:
        return {"op": self.op, "options": {k: _jsonable(v) for k, v in self.options.items()}, "counter": self.counter}


@functools.lru_cache(maxsize=4096)
def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=4096)
def _hash56(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def _canonical(options: dict) -> str:
    return json.dumps({k: _jsonable(v) for k, v in options.items()}, sort_keys=True)


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def _dist():
    return dist if dist.is_available() and dist.is_initialized() else None


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of ``group`` (None or WORLD: every rank)."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


_GROUP_FACTS: dict[tuple, tuple] = {}  # (id(WORLD), id(group)) -> (group, ranks, my index, mirror, timeout)
_WORLD_SEEN: list = [None]  # a weak reference to the default group the caches were filled under


def _world_key() -> int:
    """Identifies the current default process group. A new one (after ``destroy_process_group``
    and a fresh ``init_process_group``) empties the caches: the old world's gloo mirrors are let go
    rather than kept running, and an ``id`` reused by the new world cannot find them."""
    world = dist.group.WORLD
    seen = _WORLD_SEEN[0]
    if seen is None or seen() is not world:
        with _HOST_LOCK:
            _GROUP_FACTS.clear()
            _HOST_GROUPS.clear()
            _WORLD_SEEN[0] = weakref.ref(world)
    return id(world)


def _facts(group):
    """(ranks, my index in them, gloo mirror, timeout) of ``group``, computed once per group (the
    timeout is read then: set ``HF_ZERO3_AGREE_TIMEOUT`` before a group's first agreement)."""
    key = (_world_key(), id(group) if group is not None else 0)
    facts = _GROUP_FACTS.get(key)
    if facts is None or facts[0] is not group:
        ranks = group_ranks(group)
        mirror = host_group(group)
        facts = (group, ranks, ranks.index(_dist().get_rank()), mirror, _timeout(mirror))
        _GROUP_FACTS[key] = facts
    return facts[1:]


def _timeout(group) -> datetime.timedelta:
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        try:
            seconds = float(env)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"{TIMEOUT_ENV}={env!r} must be a positive number of seconds")
        return datetime.timedelta(seconds=seconds)
    return group_timeout(group) or datetime.timedelta(minutes=30)


def host_group(group=None):
    """A gloo group with ``group``'s ranks, created once per rank set (collective over those ranks
    the first time: call it where they are all present, e.g. at a call's first agreement).

    Agreements reduce host numbers; on a gloo mirror they cost a loopback round trip and never wait
    for the GPU (an NCCL all-reduce read back with ``.tolist()`` waits for every queued kernel), and
    they cannot pair with a collective of DeepSpeed's or the user's on ``group`` itself.
    """
    dist = _dist()
    ranks = group_ranks(group)
    key = (_world_key(), ranks)
    with _HOST_LOCK:
        if key not in _HOST_GROUPS:
            try:
                _HOST_GROUPS[key] = dist.new_group(
                    list(ranks), backend="gloo", timeout=_timeout(group), use_local_synchronization=True
                )
            except Exception as exc:  # a torch built without gloo: agree over the group itself
                warnings.warn(
                    f"hf_zero3: no gloo group for agreements ({exc}); agreeing over the group's own "
                    "backend, which waits for the GPU and shares the group's collective order",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _HOST_GROUPS[key] = group
        return _HOST_GROUPS[key]


def agree(
    tag: Tag, group=None, values: Sequence[int] = (), *, error: BaseException | None = None, record: bool = False
) -> list[int]:
    """Element-wise maximum of integer ``values`` over ``group``, after checking that every rank is
    in the same operation (``tag``) and that none failed.

    ``error``: this rank's local failure; every rank then raises the same
    :class:`~hf_zero3.errors.RankFailure` (chained to ``error`` here). ``record``: write this
    rank's position to the c10d store first, so a rank that never arrives can be named by where
    it last agreed (a generate() call's start and end, regions, training steps; a generate()
    call's stop checks skip it).
    Without ``torch.distributed`` (or with one rank) the values come back as they are and
    ``error`` is re-raised.
    """
    vals = [int(v) for v in values]
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return vals
    ranks, me, hg, timeout = _facts(group)
    if record:
        _record_position(ranks, tag)
    small = len(vals) <= SMALL
    digest = tag.digest(len(vals), 0 if small else len(vals))
    payload = (vals if small else []) + [0] * (SMALL - (len(vals) if small else 0))
    vec = torch.tensor([digest, -digest, int(error is not None)] + payload, dtype=torch.int64)
    _wait(dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=hg, async_op=True), timeout, tag, ranks)
    out = vec.tolist()
    if out[2] or out[0] != -out[1]:  # a rank failed, or the ranks are not in the same agreement
        _raise_shared(tag, error, ranks, hg, timeout)
    if small:
        result = out[3 : 3 + len(vals)]
    else:
        big = torch.tensor(vals, dtype=torch.int64)
        _wait(dist.all_reduce(big, op=dist.ReduceOp.MAX, group=hg, async_op=True), timeout, tag, ranks)
        result = big.tolist()
    return result


def _wait(work, timeout: datetime.timedelta, tag: Tag, ranks) -> None:
    try:
        work.wait(timeout=timeout)
    except Exception as exc:  # timed out (or the peer's process died): say who is missing
        raise RankDivergenceError(_missing_message(tag, ranks, exc, timeout.total_seconds())) from exc


def _raise_shared(tag: Tag, error, ranks, hg, timeout) -> None:
    """Error path: exchange every rank's tag and failure (fixed size), raise the same error."""
    dist = _dist()
    detail = {"tag": tag.to_json()}
    if error is not None:
        detail["error"] = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
        detail["base"] = builtin_base(type(error))
    raw = json.dumps(detail).encode()[:DETAIL_BYTES]
    buf = torch.zeros(DETAIL_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in ranks]
    _wait(dist.all_gather(bufs, buf, group=hg, async_op=True), timeout, tag, ranks)
    details = {}
    for r, b in zip(ranks, bufs):
        data = bytes(b.tolist()).rstrip(b"\0")
        try:
            details[r] = json.loads(data.decode(errors="replace"))
        except ValueError:  # truncated mid-JSON: keep what is readable
            details[r] = {"tag": {"op": "?", "options": {}, "counter": -1}, "error": data.decode(errors="replace")}
    tags = {r: Tag(d["tag"]["op"], d["tag"]["options"], d["tag"]["counter"]) for r, d in details.items()}
    failed = [r for r in ranks if "error" in details[r]]
    if failed:
        failures = {r: details[r].get("error", "failed") for r in failed}
        bases = {details[r].get("base", "RuntimeError") for r in failed}
        where = "; ".join(f"rank {r} in {tags[r].describe()}: {failures[r]}" for r in failed)
        msg = (
            f"hf_zero3: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of the group "
            f"(ranks {list(ranks)}) failed, so every rank of the group raises this error instead of "
            f"waiting: {where}"
        )
        try:
            exc = rank_failure_type(bases.pop() if len(bases) == 1 else "RuntimeError")(msg, tag.op, failures)
        except TypeError:  # a builtin whose constructor takes more than a message (UnicodeDecodeError)
            exc = RankFailure(msg, tag.op, failures)
        if error is not None:
            raise exc from error
        raise exc
    raise RankDivergenceError(_divergence_message(tags, ranks))


def _divergence_message(tags: dict, ranks) -> str:
    fields = []
    first = next(iter(tags.values()))
    for name in ("op", "counter"):
        if len({getattr(t, name) for t in tags.values()}) > 1:
            fields.append({"op": "operation", "counter": "call count"}[name])
    keys = sorted({k for t in tags.values() for k in t.options})
    for k in keys:
        if len({repr(t.options.get(k)) for t in tags.values()}) > 1:
            fields.append(k)
    where = "; ".join(f"rank {r} is in {t.describe()}" for r, t in tags.items())
    hint = (
        "an hf_zero3 operation (generate, an eval region, a TRL generation round) ran on some ranks "
        "only, or with options that differ per rank"
    )
    if fields and all(f not in ("operation", "call count") for f in fields):
        hint = f"pass the same {', '.join(fields)} on every rank"
    return (
        f"hf_zero3: the ranks {list(ranks)} of a ZeRO-3 group are out of step at {first.op!r} (nothing was "
        f"gathered yet): {where}. They differ in: {', '.join(fields) or 'the agreement size'}. Every rank must "
        f"run the same hf_zero3 operations in the same order; {hint}."
    )


# --- positions, for naming a rank that never arrives --------------------------------------------


def _position_key(ranks, rank) -> str:
    return f"hf_zero3/pos/{_crc(repr(tuple(ranks)))}/{rank}"


def _record_position(ranks, tag: Tag) -> None:
    try:
        dist = _dist()
        default_store().set(_position_key(ranks, dist.get_rank()), json.dumps({**tag.to_json(), "time": time.time()}))
    except Exception:  # diagnostics only: never fail an agreement over them
        pass


def _missing_message(tag: Tag, ranks, exc, waited: float) -> str:
    dist = _dist()
    me = dist.get_rank()
    lines = []
    try:
        store = default_store()
        for r in ranks:
            if r == me:
                continue
            key = _position_key(ranks, r)
            if store.check([key]):
                pos = json.loads(store.get(key).decode())
                t = Tag(pos["op"], pos["options"], pos["counter"])
                lines.append(f"rank {r} last agreed in {t.describe()} {time.time() - pos['time']:.0f} s ago")
            else:
                lines.append(f"rank {r} has not reached any hf_zero3 agreement yet")
    except Exception:
        lines.append("the other ranks' positions could not be read")
    return (
        f"hf_zero3: rank {me} waited {waited:.0f} s in {tag.describe()} for the "
        f"other ranks of {list(ranks)}; {'; '.join(lines)}. A rank that skipped this call (main-process-only "
        f"generate, an extra call on one rank) or is stuck in another collective never arrives; "
        f"raise {TIMEOUT_ENV} if a rank is legitimately slower. ({type(exc).__name__}: {exc})"
    )


# --- the plain reductions every decision uses ----------------------------------------------------


def all_max(values: Sequence[float | int], group=None, tag: Tag | None = None) -> list[int]:
    """Element-wise maximum of integer ``values`` over ``group`` (one tagged agreement)."""
    return agree(tag or Tag("agree"), group, values)


def all_min(values: Sequence[float | int], group=None, tag: Tag | None = None) -> list[int]:
    """Element-wise minimum of integer ``values`` over ``group``."""
    return [-v for v in all_max([-int(v) for v in values], group, tag)]


def all_equal(values: Sequence[float | int], group=None, tag: Tag | None = None) -> bool:
    """True when every rank passed the same integer ``values`` (one agreement)."""
    vals = [int(v) for v in values]
    packed = all_max(vals + [-v for v in vals], group, tag)
    n = len(vals)
    return all(packed[i] == -packed[n + i] for i in range(n))
