"""The decode loop's on/off environment switches (``HF_ZERO3_FUSE_QKV``, ``HF_ZERO3_TRITON_MLP``,
``HF_ZERO3_SPLIT_K``, ``HF_ZERO3_COMPILE_PREFILL``, ``HF_ZERO3_FUSE_ROPE``, ``HF_ZERO3_PDL``,
``HF_ZERO3_TRITON_QKV``: on
unless set to 0/false/no/off), read one way."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def on(name: str, default: bool = True) -> bool:
    """Whether the switch ``name`` is on at this moment (unset or empty: ``default``)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in _ON if not default else value not in _OFF
