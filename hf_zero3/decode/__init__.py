"""The fast decode engine: hf_zero3's static decode loop (:mod:`.static_loop`) and the parts of a
decode step it computes its own way (:mod:`.features`: the fused q/k/v projection, the MLP and
split-K GEMMs, the grouped-query attention and its rope kernel, dependent launches), with the
model families whose code it replaces (:mod:`.families`). Lockstep generation
(:mod:`hf_zero3.generation`) calls it where a call can take it; nothing here runs a collective."""

from .features import DecodeReport

__all__ = ["DecodeReport"]
