"""The one place hf_zero3 changes another library's behaviour, and the one place to undo it.

A patch is installed by name, once, only by the feature that needs it (the memory plan's two
accelerate/DeepSpeed wrappers, the TRL generation adapter); :func:`unpatch` removes all of them
(``hf_zero3.unpatch()``), and :func:`scope` removes the ones installed inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

_LOCK = threading.RLock()
_UNDO: dict[str, Callable[[], None]] = {}  # name -> undo, in installation order


def install(name: str, apply: Callable[[], Callable[[], None]]) -> bool:
    """Run ``apply()`` (which patches and returns its undo function) unless ``name`` is installed.
    Returns True when this call installed it."""
    with _LOCK:
        if name in _UNDO:
            return False
        _UNDO[name] = apply()
        return True


def remove(name: str) -> bool:
    with _LOCK:
        undo = _UNDO.pop(name, None)
    if undo is None:
        return False
    undo()
    return True


def unpatch() -> list[str]:
    """Undo every patch hf_zero3 installed, newest first; returns their names."""
    with _LOCK:
        names = list(_UNDO)
    for name in reversed(names):
        remove(name)
    return names


def installed() -> list[str]:
    with _LOCK:
        return list(_UNDO)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Patches installed inside the block are removed when it exits (those installed before stay)."""
    before = set(installed())
    try:
        yield
    finally:
        for name in reversed(installed()):
            if name not in before:
                remove(name)
