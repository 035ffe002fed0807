"""TRL and DeepSpeed rollouts under ZeRO-3: no hang, no second gather, calls aligned across ranks.

* :func:`apply` (what ``Zero3Safe`` does on a TRL trainer): lockstep generation that reuses the
  model TRL already gathered, and collective tool loops, GKD draws and completion logging.
* :func:`early_stop`: DeepSpeed's ``HybridEngineRollout`` with EOS restored and the group's
  synchronized early stop.
* under DeepCompile, TRL's fused LM head is swapped for a traceable logits head when training
  begins (:mod:`hf_zero3.trainer.trl_fused_head`; done by ``Zero3Safe`` / :func:`apply`).

The adapters live beside ``Zero3Safe`` (:mod:`hf_zero3.trainer.trl_adapter`), which applies them;
:func:`apply` is the entry above both, for a trainer that already exists.
"""

from ..trainer.callback import Zero3Safe
from ..trainer.trl_adapter import DEEPCOMPILE_PAD_TO_MULTIPLE_OF, adapt, runs_zero3
from .rollout import early_stop

__all__ = ["DEEPCOMPILE_PAD_TO_MULTIPLE_OF", "apply", "early_stop"]


def apply(trainer, zero3safe=None) -> list[str]:
    """Make ``trainer`` (a TRL trainer) safe under ZeRO-3; returns the names of what was adapted.

    Without ``zero3safe`` a :class:`~hf_zero3.Zero3Safe` is created, bound to the trainer and
    added as a callback (so ``apply(trainer)`` after construction equals passing
    ``callbacks=[Zero3Safe()]``). Local: nothing is exchanged until the first adapted call.
    Tool rounds of a vLLM trainer are left as they are (vLLM generates outside the ZeRO-3 group).
    A trainer whose DeepSpeed config is not ZeRO-3 is left alone.
    """
    if not runs_zero3(trainer):
        return []
    if zero3safe is None:
        zero3safe = Zero3Safe(trl=False)
        zero3safe.bind(trainer, trainer.model)
        trainer.add_callback(zero3safe)
    return adapt(trainer)
