"""TRL and DeepSpeed rollouts under ZeRO-3: no hang, no second gather, calls aligned across ranks.

* :func:`apply` (what ``Zero3Safe`` does on a TRL trainer): lockstep generation that reuses the
  model TRL already gathered, and collective tool loops, GKD draws and completion logging.
* :func:`early_stop`: DeepSpeed's ``HybridEngineRollout`` with EOS restored and the group's
  synchronized early stop.
* under DeepCompile, TRL's fused LM head is swapped for a traceable logits head when training
  begins (:mod:`hf_zero3.trl.fused_head`; done by ``Zero3Safe`` / :func:`apply`).
"""

from .adapter import apply
from .rollout import early_stop

__all__ = ["apply", "early_stop"]
