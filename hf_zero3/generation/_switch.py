"""The decode loop's on/off environment switches (``HF_ZERO3_FUSE_QKV``, ``HF_ZERO3_TRITON_MLP``,
``HF_ZERO3_SPLIT_K``, ``HF_ZERO3_COMPILE_PREFILL``), read one way: on unless set to 0/false/no/off."""

from __future__ import annotations

import os


def on(name: str) -> bool:
    """Whether the switch ``name`` is on (the default) at this moment."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
