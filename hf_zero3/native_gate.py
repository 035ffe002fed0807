"""Loads the native prefetch gate (``csrc/gate.cpp``), lazily, and says whether it is there.

Two ways in: a prebuilt module (``HF_ZERO3_BUILD_EXT=1 pip install --no-build-isolation .``
builds ``hf_zero3.native_gate_ext``), else a JIT build of ``csrc/`` with ninja through
``torch.utils.cpp_extension`` (cached under ``TORCH_EXTENSIONS_DIR``). Without CUDA, or when the
build fails, :func:`is_available` is False and :mod:`hf_zero3.compile.gate` runs its pure-PyTorch
fallback, which takes the same decisions. ``HF_ZERO3_NATIVE=0`` (any switch's off) turns the native path off;
``HF_ZERO3_NATIVE=cpu`` builds the C++ part without CUDA (tests use it to compare decisions).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .options import parse_choice

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_state: dict = {}


def _want() -> str:
    """``HF_ZERO3_NATIVE``: ``auto`` (unset), ``cpu``, or a switch (off: ``"off"``)."""
    raw = os.environ.get("HF_ZERO3_NATIVE", "")
    return parse_choice("HF_ZERO3_NATIVE", raw, ("auto", "cpu")) if raw.strip() else "auto"


def load(verbose: bool = False):
    """The native module, or None (see :func:`unavailable_reason`). Built at most once."""
    if "module" in _state:
        return _state["module"]
    mode = _want()
    module, reason = None, None
    if mode == "off":
        reason = "disabled by HF_ZERO3_NATIVE (off)"
    elif mode != "cpu" and not torch.cuda.is_available():
        reason = "no CUDA device: the gate reads the CUDA caching allocator"
    else:
        with_cuda = mode != "cpu"
        try:
            if with_cuda:
                from hf_zero3 import native_gate_ext as module  # optional: the native extension, prebuilt at install
        except ImportError:
            module = None
        if module is None:
            src = CSRC / "gate.cpp"
            if not src.exists():
                reason = (
                    f"{src} is missing (not a source checkout) and hf_zero3.native_gate_ext was not "
                    f"prebuilt; reinstall with HF_ZERO3_BUILD_EXT=1 pip install --no-build-isolation ."
                )
            else:
                try:
                    # optional: the JIT build (torch.utils.cpp_extension, with ninja and a compiler)
                    from torch.utils.cpp_extension import load as jit_load

                    flags = ["-O2"] + (["-DHF_ZERO3_WITH_CUDA"] if with_cuda else [])
                    module = jit_load(
                        name="hf_zero3_gate" + ("" if with_cuda else "_cpu"),
                        sources=[str(src)],
                        extra_cflags=flags,
                        with_cuda=with_cuda,
                        verbose=verbose,
                    )
                except Exception as exc:  # compiler, ninja or CUDA toolkit missing
                    reason = f"building {src} failed: {type(exc).__name__}: {exc}"
                    warnings.warn(
                        f"hf_zero3: native prefetch gate unavailable, using the PyTorch fallback ({reason})",
                        RuntimeWarning,
                        stacklevel=2,
                    )
    _state["module"], _state["reason"] = module, reason
    return module


def is_available() -> bool:
    """True when the native gate is loaded (it is built on first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")
