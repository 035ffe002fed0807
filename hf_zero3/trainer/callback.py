"""``Zero3Safe``: the one line a ``transformers.Trainer`` (or TRL trainer) user adds.

``Trainer(..., callbacks=[Zero3Safe()])`` makes evaluation, prediction, ``eval_on_start``,
``Seq2SeqTrainer(predict_with_generate=True)``, user ``model.generate()`` calls and TRL's
rollouts correct under DeepCompile ZeRO-3 and plain ZeRO-3, and does nothing under ZeRO-1/2 or
without DeepSpeed.

Trainer has no "evaluation begins" event, so the callback arms the model instead: the first eval
forward opens a gathered region (agreed across ranks, see :mod:`hf_zero3.gathering`), and
``on_evaluate`` / ``on_predict`` / the next training step or forward close it, before the compiled
training graph runs again. The callback finds its Trainer when ``Trainer.__init__`` ends
(``on_init_end``) and wraps that instance's ``evaluate``/``predict``: a call that raises on any
rank releases its region at once and every rank raises the same error.

Under DeepCompile ZeRO-3 (read from the Trainer's DeepSpeed config) it also enables hf_zero3's
memory plan (:mod:`hf_zero3.compile`) in place of DeepSpeed's prefetch + selective_gather
schedule; ``memory_plan=False`` keeps DeepSpeed's schedule. On a TRL trainer it applies
:func:`hf_zero3.trl.apply`.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref

from transformers import TrainerCallback

from .. import zero3
from .._upstream import deepspeed as ds_up
from .._upstream import transformers_trainer as trainer_up
from .._upstream import trl as trl_up
from .._upstream.versions import check_versions
from ..accelerate import enable_memory_plan
from ..accelerate.plugin import wants_memory_plan
from ..compile.config import SECTION
from ..errors import Zero3Error
from ..gathering import arm_eval_region, close_eval_region
from ..generation.config import LockstepConfig, lockstep_config
from ..generation.lockstep import base_module, is_generation_model, lockstep_class, set_lockstep_config
from ..runtime import runtime_of
from . import trl_adapter

log = logging.getLogger("hf_zero3.trainer")


class Zero3Safe(TrainerCallback):
    """Trainer callback for ZeRO-3 / DeepCompile safety.

    Args:
        lockstep: how generation runs in lockstep and how eval gathers (a
            :class:`~hf_zero3.LockstepConfig`; its ``gather`` is also the eval regions'). Its
            fields may be given as keywords instead (``Zero3Safe(sync_every=4)``), over it.
        strict_versions: raise (instead of warn) when an installed library is older than supported.
        memory_plan: under DeepCompile ZeRO-3, use hf_zero3's memory plan (see :mod:`hf_zero3.compile`).
        trl: on a TRL trainer, apply :func:`hf_zero3.trl.apply` (reuse TRL's gathered model, align
            generation calls across ranks).
    """

    def __init__(
        self,
        lockstep: LockstepConfig | None = None,
        *,
        strict_versions: bool = False,
        memory_plan: bool = True,
        trl: bool = True,
        **lockstep_options,
    ):
        self.lockstep = lockstep_config(lockstep, **lockstep_options).validate()
        self.memory_plan, self.trl = memory_plan, trl
        problems = check_versions("core")
        if problems:
            msg = "hf_zero3.Zero3Safe: " + "; ".join(problems)
            if strict_versions:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)
        self._trainer = None
        self._warned_uncompiled = False

    @property
    def gather(self) -> str:
        """How eval regions gather: the lockstep config's ``gather``."""
        return self.lockstep.gather

    @property
    def trainer(self):
        return self._trainer() if self._trainer is not None else None

    # -- install -----------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        trainer = trainer_up.trainer_calling_callback()
        if trainer is None:
            self._install(model)
            return
        self.bind(trainer, model)
        if self.trl and trl_up.is_trl_trainer(trainer):
            if trl_adapter.runs_zero3(trainer):
                trl_adapter.adapt(trainer)

    def bind(self, trainer, model=None) -> None:
        """Serve ``trainer`` (done by ``on_init_end``; :func:`hf_zero3.trl.apply` calls it for a
        callback added after construction): wrap its ``evaluate``/``predict``, enable the memory
        plan for a DeepCompile ZeRO-3 config, and install on its model. Local."""
        self._trainer = weakref.ref(trainer)
        self._wrap_eval_entry_points(trainer)
        self._wrap_train(trainer)
        self._enable_memory_plan(trainer)
        self._install(model if model is not None else trainer.model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._install(model)
        self._attach_engine()
        self._check_compiled()
        trainer = self.trainer
        if trainer is not None and getattr(trainer, "_hf_zero3_trl_adapted", False):
            trl_adapter.before_training(trainer)

    def _install(self, model) -> None:
        """Lockstep generation on generation models; eval regions on every model (local)."""
        if model is None:
            return
        target = base_module(model)
        generation = is_generation_model(target)
        target.__class__ = lockstep_class(type(target), generation=generation)
        arm_eval_region(model, self.gather)
        if generation:
            set_lockstep_config(model, self.lockstep)
        elif not getattr(self, "_said_no_generate", False):
            self._said_no_generate = True
            log.info(
                "hf_zero3.Zero3Safe: %s has no generate(); protecting its eval/predict forwards only",
                type(target).__name__,
            )

    def _attach_engine(self) -> None:
        trainer = self.trainer
        engine = trainer_up.trainer_engine(trainer) if trainer is not None else None
        if engine is not None:
            runtime_of(engine)

    def _enable_memory_plan(self, trainer) -> None:
        """Install the memory plan's accelerate/DeepSpeed wrappers only for a DeepCompile ZeRO-3 run."""
        if not self.memory_plan:
            return
        config = trainer_up.trainer_deepspeed_config(trainer) or {}
        if wants_memory_plan(config) or SECTION[0] in config:  # the plan, or our section's "auto"s to resolve
            enable_memory_plan()

    def _wrap_eval_entry_points(self, trainer) -> None:
        """``evaluate``/``predict`` on this Trainer instance: release the region and share a failure."""
        for name in ("evaluate", "predict"):
            original = getattr(trainer, name)
            if getattr(original, "_hf_zero3_wrapped", False):
                continue
            setattr(trainer, name, _collective_entry(self, name, original))

    def _wrap_train(self, trainer) -> None:
        """``train`` on this Trainer instance: a second call starts from the DeepSpeed config the
        Trainer was built with, without the engine of the first (transformers frees that engine
        and keeps pointing at it: :func:`hf_zero3._upstream.transformers_trainer.forget_engine`). Every
        rank calls ``train()``, so every rank does the same."""
        original = trainer.train
        if getattr(original, "_hf_zero3_wrapped", False):
            return
        config = trainer_up.trainer_deepspeed_config_copy(trainer)

        @functools.wraps(original)
        def train(*args, **kwargs):
            owner = self.trainer
            if config is not None and owner is not None and trainer_up.trainer_has_engine(owner):
                trainer_up.forget_engine(owner, config)
            return original(*args, **kwargs)

        train._hf_zero3_wrapped = True
        trainer.train = train

    # -- release gathered parameters before training runs again -------------------------------
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        _close(model)
        # One agreement per step: an hf_zero3 call that ran on some ranks only (an extra generate,
        # a main-process-only eval region) is named here at the latest, not at the timeout.
        if model is not None and zero3.is_zero3_model(model):
            rt = runtime_of(model)
            try:
                group = rt.group
            except ValueError:  # parameters over several groups (MoE): no one group to agree over
                return
            if zero3.group_world_size(group) > 1:
                rt.agree("trainer.step", step=state.global_step)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        _close(model)

    def on_predict(self, args, state, control, model=None, **kwargs):
        _close(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        _close(model)

    def _check_compiled(self) -> None:
        trainer = self.trainer
        engine = trainer_up.trainer_engine(trainer) if trainer is not None else None
        if engine is None or self._warned_uncompiled:
            return
        if ds_up.deepcompile_enabled(engine) and not ds_up.deepcompile_active(engine):
            self._warned_uncompiled = True
            warnings.warn(
                "DeepCompile is enabled in the DeepSpeed config (compile.deepcompile=true) but the "
                "engine was never compiled, so training runs eager ZeRO-3 (slower, and DeepCompile's "
                "memory settings are ignored). Set TrainingArguments(torch_compile=True) or call "
                "engine.compile().",
                stacklevel=2,
            )


def _collective_entry(callback: Zero3Safe, name: str, original):
    """Wrap ``Trainer.evaluate``/``predict``: on return or exception the eval region is released
    (local), and under ZeRO-3 the ranks agree the call ended, so one rank's failure is every rank's
    (an error hf_zero3 already shared is raised as it is). A call before ``train()`` leaves the
    Trainer as it was: the DeepSpeed config it shares restored, its inference engine freed
    (:func:`hf_zero3._upstream.transformers_trainer.forget_engine`)."""

    @functools.wraps(original)
    def entry(*args, **kwargs):
        trainer = callback.trainer
        # before train(): this call builds an inference engine that train() would trip over
        config = trainer_up.pretrain_eval_config(trainer) if trainer is not None else None
        error = None
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            model = getattr(trainer, "model", None) if trainer is not None else None
            _close(model)
            if config is not None:  # the user's config back, the engine freed (same on every rank)
                trainer_up.forget_engine(trainer, config)
            callback._attach_engine()
            shared = isinstance(error, Zero3Error) or (error is not None and not isinstance(error, Exception))
            if model is not None and zero3.is_zero3_model(model) and not shared:  # (KeyboardInterrupt: no)
                rt = runtime_of(model)
                if error is None:
                    rt.agree(f"trainer.{name}.end")
                else:  # raises the shared failure (chained to ours) on every rank
                    rt.agree(f"trainer.{name}.end", error=error)

    entry._hf_zero3_wrapped = True
    return entry


def _close(model) -> None:
    if model is not None:
        close_eval_region(model)
