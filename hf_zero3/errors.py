"""The errors every rank of a group raises together.

hf_zero3 never lets one rank raise alone: a rank-local failure is shared at the next agreement, and
every rank raises the same :class:`RankFailure` naming the failing rank(s) and their messages. A
:class:`RankFailure` is also an instance of the failing rank's own builtin exception type
(``ValueError`` for a bad argument, say), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import builtins
import functools

__all__ = ["Zero3Error", "RankDivergenceError", "RankFailure", "rank_failure_type", "builtin_base"]


class Zero3Error(Exception):
    """Base class of the errors hf_zero3 raises on every rank of a group at once."""


class RankDivergenceError(Zero3Error, RuntimeError):
    """The ranks of a group are out of step: they reached an agreement in different operations, with
    different options or call counts, or one rank never reached it. Raised on every rank that
    arrived, before any parameter is gathered."""


class RankFailure(Zero3Error):
    """A rank of the group failed (bad input, a refused option, an exception mid-call); every rank of
    the group raises this, naming the failing ranks. ``failures`` maps rank -> message."""

    def __init__(self, message: str, op: str = "", failures: dict | None = None):
        super().__init__(message)
        self.op = op
        self.failures = dict(failures or {})


def builtin_base(exc_type: type) -> str:
    """The nearest builtin exception class in ``exc_type``'s MRO (its name)."""
    for cls in exc_type.__mro__:
        if cls.__module__ == "builtins" and issubclass(cls, Exception):
            return cls.__name__
    return "RuntimeError"


@functools.lru_cache(maxsize=None)
def rank_failure_type(base_name: str) -> type:
    """``RankFailure`` combined with a builtin exception class, e.g. ``RankFailure`` + ``ValueError``."""
    base = getattr(builtins, base_name, RuntimeError)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base is Exception:
        return RankFailure
    cls = type(f"Rank{base.__name__}", (RankFailure, base), {"__module__": __name__})
    globals()[cls.__name__] = cls  # picklable by name (results cross process boundaries in tests)
    return cls
