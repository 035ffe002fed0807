"""transformers' ``Trainer`` as hf_zero3 reads it: the Trainer running a callback, its DeepSpeed
engine and config, and the way back from an engine it freed. Checked against the releases in
:data:`hf_zero3._upstream.transformers.CHECKED`."""

from __future__ import annotations

import copy
import sys

from transformers import Trainer

from .deepspeed import is_engine, remove_engine_forward_hooks


def trainer_calling_callback(max_depth: int = 8):
    """The ``transformers.Trainer`` whose ``__init__`` is running the current callback event.

    ``Trainer.__init__`` ends with ``self.callback_handler.on_init_end(...)``; walking up from the
    callback finds that frame's ``self``. None when called from anywhere else.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
    return None


def trainer_engine(trainer):
    """The DeepSpeed engine a Trainer trains (``model_wrapped`` after ``accelerator.prepare``)."""
    wrapped = getattr(trainer, "model_wrapped", None)
    return wrapped if wrapped is not None and is_engine(wrapped) else None


def trainer_deepspeed_config(trainer) -> dict | None:
    """The DeepSpeed config dict a Trainer will hand to ``deepspeed.initialize`` (None: no DeepSpeed)."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    return config if isinstance(config, dict) else None


# -- transformers: a Trainer keeps pointing at the engine it frees --------------------------------
# ``train()`` starts by freeing the engine the Trainer has (``accelerator.free_memory``) while
# ``model_wrapped`` and ``deepspeed`` still point at it: ``_wrap_model`` hands the freed engine back,
# no training engine is built and the first ``backward`` fails on None. Two ways in: ``evaluate()``
# or ``predict()`` before training (``evaluation_loop`` builds a ZeRO-3 inference engine, and
# ``deepspeed_init(inference=True)`` also deletes the optimizer from the DeepSpeed config the
# Trainer, accelerate's plugin and transformers share, and writes its scheduler's "auto" step
# counts for 0 steps), and a second ``train()`` (the first engine; the config's "auto"s filled for
# the first run). transformers 5.17-5.25 (upstream: transformers PR #44889, open).
def trainer_has_engine(trainer) -> bool:
    """``trainer`` holds a DeepSpeed engine (its ``deepspeed``) that its next ``train()`` would free."""
    return getattr(trainer, "deepspeed", None) is not None


def pretrain_eval_config(trainer) -> dict | None:
    """A copy of the DeepSpeed config ``trainer`` shares, when its next evaluation builds an
    inference engine (DeepSpeed on, no engine yet; None otherwise)."""
    if not getattr(trainer, "is_deepspeed_enabled", False) or trainer_has_engine(trainer):
        return None
    return trainer_deepspeed_config_copy(trainer)


def trainer_deepspeed_config_copy(trainer) -> dict | None:
    """A deep copy of the DeepSpeed config ``trainer`` shares (None: no DeepSpeed)."""
    config = trainer_deepspeed_config(trainer)
    return copy.deepcopy(config) if config is not None else None


def forget_engine(trainer, config: dict) -> bool:
    """Put ``trainer`` back as it was before it built its engine: the shared DeepSpeed config
    restored in place to ``config`` (a copy taken before), the engine freed with its forward hooks,
    ``model_wrapped`` the model and no ``deepspeed``, so that ``train()`` builds its engine from the
    user's config. Returns whether an engine was freed."""
    live = trainer_deepspeed_config(trainer)
    if live is not None and live != config:
        live.clear()
        live.update(copy.deepcopy(config))
    engine = getattr(trainer, "deepspeed", None)
    if engine is None:
        return False
    trainer.accelerator.free_memory()  # destroys the engine (accelerate's reference goes)
    remove_engine_forward_hooks(engine)
    trainer.model_wrapped = trainer.model
    trainer.deepspeed = None
    return True
