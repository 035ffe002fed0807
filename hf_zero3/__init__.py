"""hf_zero3: DeepSpeed ZeRO-3 and DeepCompile, safe and fast inside the Hugging Face stack.

Public API (imported lazily, so ``import hf_zero3`` stays cheap):

* :class:`Zero3Safe` - the ``transformers.Trainer`` callback: eval, predict and generate work
  under DeepCompile ZeRO-3 and generation runs in lockstep.
* :func:`eval_forward` - the same protection for forwards outside the Trainer.
* :func:`lockstep`, :func:`lockstep_generate`, :class:`Zero3GenerationMixin` - lockstep generation,
  configured by one :class:`LockstepConfig`; :class:`DecodeOptions` picks the parts of its fast
  decode path; :func:`release_decode_graphs` frees what compiled decoding keeps between calls.
* :func:`gathered_forwards` - the gather-all / layer-wise region both build on.
* :class:`Zero3DeepSpeedPlugin`, :func:`enable_memory_plan` - DeepCompile's memory-budgeted
  prefetch plan through accelerate, set by :class:`MemoryPlanConfig`;
  :func:`compile_with_memory_plan` for a bare engine.
* :func:`runtime_of` - the per-model state: the last generation's report, the memory plan.
* :class:`Zero3Error` and its kinds :class:`RankFailure`, :class:`RankDivergenceError` - the
  errors every rank of a group raises together.
* :func:`unpatch`, :func:`patching` - undo the patches hf_zero3 installed.

Subpackages with their own public API: :mod:`hf_zero3.trl`, :mod:`hf_zero3.accelerate`,
:mod:`hf_zero3.compile`, :mod:`hf_zero3.generation`, :mod:`hf_zero3.decode`, :mod:`hf_zero3.errors` and
:mod:`hf_zero3.testing` (a multi-process launcher, strict ZeRO-3 configs, tiny models, for a
user's own tests). What each exports is its ``__all__``; ``docs/reference/api.md`` documents it.
"""

import importlib

from ._upstream.patches import scope as _scope
from ._upstream.patches import unpatch as _unpatch

__version__ = "0.2.0"

_LAZY = {
    "Zero3Safe": "hf_zero3.trainer",
    "eval_forward": "hf_zero3.trainer",
    "lockstep": "hf_zero3.generation",
    "lockstep_generate": "hf_zero3.generation",
    "Zero3GenerationMixin": "hf_zero3.generation",
    "LockstepConfig": "hf_zero3.generation",
    "DecodeOptions": "hf_zero3.options",
    "release_decode_graphs": "hf_zero3.generation",
    "gathered_forwards": "hf_zero3.gathering",
    "Zero3DeepSpeedPlugin": "hf_zero3.accelerate",
    "enable_memory_plan": "hf_zero3.accelerate",
    "MemoryPlanConfig": "hf_zero3.compile",
    "compile_with_memory_plan": "hf_zero3.compile.memory_plan",
    "runtime_of": "hf_zero3.runtime",
    "RankDivergenceError": "hf_zero3.errors",
    "RankFailure": "hf_zero3.errors",
    "Zero3Error": "hf_zero3.errors",
}

__all__ = sorted(_LAZY) + ["__version__", "unpatch", "patching"]


def unpatch() -> list[str]:
    """Undo every patch of accelerate / DeepSpeed / TRL that hf_zero3 installed; returns their names."""
    return _unpatch()


def patching():
    """Context manager: patches hf_zero3 installs inside the block are undone when it exits."""
    return _scope()


_SUBMODULES = (
    "trl",
    "testing",
    "compile",
    "generation",
    "trainer",
    "accelerate",
    "agree",
    "runtime",
    "zero3",
    "gathering",
    "errors",
)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"hf_zero3.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_zero3' has no attribute {name!r}")


def __dir__():
    return __all__
