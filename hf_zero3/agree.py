"""Rank agreement: every "decide, then act" in hf_zero3 decides here, over one group.

A ZeRO-3 group stays correct only while all its ranks issue the same collectives in the same
order. Any choice that changes the collectives (stop generating? gather the whole model? skip a
prefetch?) is first reduced across the group with one small all-reduce, so every rank takes the
same branch. Several decisions are packed into one call to keep it to one round trip.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["all_max", "all_min", "all_equal", "agreement_device"]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def agreement_device(group=None) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo (and others) CPU tensors."""
    dist = _dist()
    if dist is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_max(values: Sequence[float | int], group=None) -> list[int]:
    """Element-wise maximum of integer ``values`` over ``group`` (values as they are if not
    distributed). One all-reduce however many values."""
    vals = [int(v) for v in values]
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return vals
    t = torch.tensor(vals, dtype=torch.int64, device=agreement_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(x) for x in t.tolist()]


def all_min(values: Sequence[float | int], group=None) -> list[int]:
    """Element-wise minimum of integer ``values`` over ``group``."""
    return [-v for v in all_max([-int(v) for v in values], group)]


def all_equal(values: Sequence[float | int], group=None) -> bool:
    """True when every rank passed the same integer ``values`` (one all-reduce)."""
    vals = [int(v) for v in values]
    packed = all_max(vals + [-v for v in vals], group)
    n = len(vals)
    return all(packed[i] == -packed[n + i] for i in range(n))
