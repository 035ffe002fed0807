"""Lockstep generation under ZeRO-3 (see :mod:`hf_zero3.generation.lockstep`)."""

from .lockstep import (STOP_MODES, LockstepConfig, LockstepStats, Zero3GenerationMixin, lockstep,
                       lockstep_generate)

__all__ = ["STOP_MODES", "LockstepConfig", "LockstepStats", "Zero3GenerationMixin", "lockstep",
           "lockstep_generate"]
