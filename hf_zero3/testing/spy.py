"""Record which collectives a rank issues, on which group, and how many forwards a module runs,
while the real ones run."""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.distributed as dist

_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_gather_object",
    "all_reduce_coalesced",
)


class CollectiveSpy:
    """Context manager: wraps ``torch.distributed`` collectives to count them by op and group.

    The real collective still runs; ``calls`` counts ``(op, group_ranks)`` where ``group_ranks`` is
    a tuple of global ranks (``"WORLD"`` for the default group).
    """

    def __init__(self):
        self.calls: Counter = Counter()
        self._saved = {}

    def __enter__(self):
        for name in _OPS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def spy(*args, **kwargs):
            group = kwargs.get("group")
            if group is None or group is dist.group.WORLD:
                key = "WORLD"
            else:
                key = tuple(dist.get_process_group_ranks(group))
            self.calls[(name, key)] += 1
            return fn(*args, **kwargs)

        return spy

    def total(self, group=None) -> int:
        return sum(n for (op, g), n in self.calls.items() if group is None or g == group)

    def world_calls(self) -> int:
        full = tuple(range(dist.get_world_size()))
        return sum(n for (op, g), n in self.calls.items() if g == "WORLD" or g == full)


class ForwardCounter:
    """Counts top-level forwards of a module (decode steps, prefill included), in a tensor: a
    compiled forward (Dynamo would recompile on a Python int that changes) and a replayed CUDA
    graph count as an eager one does. ``remove()`` takes the hook off."""

    def __init__(self, module):
        self.n = torch.zeros((), dtype=torch.long, device=next(module.parameters()).device)
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.n.add_(1)

    def take(self) -> int:
        n = int(self.n)
        self.n.zero_()
        return n

    def remove(self) -> None:
        self.handle.remove()
