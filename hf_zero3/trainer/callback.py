"""``Zero3Safe``: the one line a ``transformers.Trainer`` user adds.

``Trainer(..., callbacks=[Zero3Safe()])`` makes evaluation, prediction, ``eval_on_start``,
``Seq2SeqTrainer(predict_with_generate=True)`` and user ``model.generate()`` calls correct under
DeepCompile ZeRO-3 and plain ZeRO-3, and does nothing under ZeRO-1/2 or without DeepSpeed.

Trainer has no "evaluation begins" event, so the callback arms the model instead: the first eval
forward opens a gathered region (agreed across ranks, see :mod:`hf_zero3.gathering`), and
``on_evaluate`` / ``on_predict`` / the next training step or forward close it, before the compiled
training graph runs again.

Under DeepCompile ZeRO-3 it also enables hf_zero3's memory plan (:mod:`hf_zero3.compile`) in place
of DeepSpeed's prefetch + selective_gather schedule, configured by the DeepSpeed config's
``hf_zero3.memory_plan`` section; ``memory_plan=False`` keeps DeepSpeed's schedule.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from .. import _compat, zero3
from ..gathering import GATHER_MODES, close_eval_region
from ..generation.lockstep import STOP_MODES, lockstep

__all__ = ["Zero3Safe"]


class Zero3Safe(TrainerCallback):
    """Trainer callback for ZeRO-3 / DeepCompile safety.

    Args:
        gather: eval and generation gathering: ``"auto"`` (whole model when every rank has the
            memory, else layer by layer), ``"all"`` or ``"layerwise"``.
        stop: lockstep generation stop mode, ``"sync"`` or ``"fixed"``.
        sync_every: steps between stop agreements in ``"sync"`` mode.
        strict_versions: raise (instead of warn) when an installed library is older than supported.
        memory_plan: install hf_zero3's DeepCompile memory plan (see :mod:`hf_zero3.compile`);
            it must be constructed before the Trainer for the plan to reach ``engine.compile``.
    """

    def __init__(self, gather: str = "auto", stop: str = "sync", sync_every: int = 1,
                 strict_versions: bool = False, memory_plan: bool = True):
        if gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, not {gather!r}")
        if stop not in STOP_MODES:
            raise ValueError(f"stop must be one of {STOP_MODES}, not {stop!r}")
        self.gather, self.stop, self.sync_every = gather, stop, sync_every
        problems = _compat.check_versions()
        if problems:
            msg = "hf_zero3.Zero3Safe: " + "; ".join(problems)
            if strict_versions:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)
        self._warned_uncompiled = False
        if memory_plan:
            from ..accelerate import enable_memory_plan

            enable_memory_plan()

    # -- install -----------------------------------------------------------------------------
    def _install(self, model) -> None:
        if model is None or not hasattr(model, "generate"):
            return
        lockstep(model, stop=self.stop, sync_every=self.sync_every, gather=self.gather)
        target = _target(model)
        target.hf_zero3_eval_auto_region = zero3.is_zero3_model(target)
        target.hf_zero3_eval_gather = self.gather

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._install(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._install(model)
        self._check_compiled(model)

    # -- release gathered parameters before training runs again -------------------------------
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        _close(model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        _close(model)

    def on_predict(self, args, state, control, model=None, **kwargs):
        _close(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        _close(model)

    def _check_compiled(self, model) -> None:
        engine = zero3.engine_of(model) if model is not None else None
        if engine is None or self._warned_uncompiled:
            return
        if zero3.deepcompile_enabled(engine) and not zero3.deepcompile_active(engine):
            self._warned_uncompiled = True
            warnings.warn(
                "DeepCompile is enabled in the DeepSpeed config (compile.deepcompile=true) but the "
                "engine was never compiled, so training runs eager ZeRO-3 (slower, and DeepCompile's "
                "memory settings are ignored). Set TrainingArguments(torch_compile=True) or call "
                "engine.compile().", stacklevel=2)


def _target(model):
    from ..generation.lockstep import _generating_model

    return _generating_model(model)


def _close(model) -> None:
    if model is None:
        return
    try:
        target = _target(model)
    except TypeError:  # not a generation model: Zero3Safe installed nothing on it
        return
    close_eval_region(target)
