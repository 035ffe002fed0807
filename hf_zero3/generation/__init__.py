"""Lockstep generation under ZeRO-3 (see :mod:`hf_zero3.generation.lockstep`)."""

from ..decode.static_loop import release as release_decode_graphs
from .config import STOP_MODES, LockstepConfig, LockstepStats
from .lockstep import Zero3GenerationMixin, lockstep, lockstep_generate

__all__ = [
    "STOP_MODES",
    "LockstepConfig",
    "LockstepStats",
    "Zero3GenerationMixin",
    "lockstep",
    "lockstep_generate",
    "release_decode_graphs",
]
