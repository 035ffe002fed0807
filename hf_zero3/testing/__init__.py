"""Test utilities: a multi-process launcher, strict ZeRO-3 configs and tiny models.

Public so users can test their own integration the way hf_zero3 tests itself.
"""

from .configs import STRICT_ZERO3, strict_zero3_config, trainer_zero3_config
from .launcher import DistributedFailure, RankReport, free_port, mark, run_ranks

__all__ = [
    "STRICT_ZERO3",
    "strict_zero3_config",
    "trainer_zero3_config",
    "DistributedFailure",
    "RankReport",
    "free_port",
    "mark",
    "run_ranks",
]

from .spy import CollectiveSpy  # noqa: E402

__all__ += ["CollectiveSpy"]
