"""DeepSpeed configs for tests and demos.

With DeepSpeed's default ZeRO-3 settings a tiny model stays gathered after the first step (its
parameters fall under the persistence threshold and inside the reuse/prefetch windows), so a test
that forgets to keep every rank in step still passes. :func:`strict_zero3_config` turns every one
of those allowances off: each forward all-gathers each layer and releases it afterwards, as on a
real multi-billion-parameter model.
"""

from __future__ import annotations

import copy
from typing import Any

STRICT_ZERO3 = {
    "stage": 3,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 0,
    "stage3_param_persistence_threshold": 0,
}
"""The ``zero_optimization`` section of :func:`strict_zero3_config`: ZeRO-3 with no persistence,
reuse, prefetch or live-parameter allowance."""


def strict_zero3_config(
    *,
    micro_batch_size: int = 1,
    world_size: int = 1,
    grad_accum: int = 1,
    lr: float = 1e-3,
    bf16: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ZeRO-3 config in which nothing stays gathered between uses (see module docstring).

    Uses ``torch_adam`` so no fused-Adam extension has to be built on CPU.
    """
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": copy.deepcopy(STRICT_ZERO3),
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if extra:
        cfg = _merge(cfg, extra)
    return cfg


def trainer_zero3_config(*, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Strict ZeRO-3 for ``transformers.Trainer``: sizes and optimizer left to ``"auto"``."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True, "weight_decay": "auto"}},
        "zero_optimization": copy.deepcopy(STRICT_ZERO3),
        "steps_per_print": 10**9,
    }
    if extra:
        cfg = _merge(cfg, extra)
    return cfg


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
