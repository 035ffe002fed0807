"""One reading of a CUDA device's memory, shared by the eval-gather decision (:mod:`hf_zero3.gathering`)
and the DeepCompile budget and prefetch gate (:mod:`hf_zero3.compile`), so both see the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._upstream.torch import cuda_memory_fraction


@dataclass(frozen=True)
class MemoryState:
    """One device's memory, in bytes: the caching allocator's and the driver's view."""

    allocated: int
    reserved: int
    free: int
    total: int
    fraction: float = 1.0

    @property
    def non_pytorch(self) -> int:
        """Used on the device but not by this process's caching allocator (CUDA context, NCCL,
        cuBLAS workspaces, other processes)."""
        return max(0, self.total - self.free - self.reserved)

    @property
    def fragmentation(self) -> int:
        """Reserved by the allocator but not allocated: cached blocks a large request may not fit."""
        return max(0, self.reserved - self.allocated)

    @property
    def allocatable(self) -> int:
        """What this process can still allocate: the device's free memory plus its own cached but
        unused blocks, and no more than a per-process fraction cap leaves above what is allocated."""
        free = self.free + self.fragmentation
        if self.fraction < 1.0:
            return max(0, min(free, int(self.total * self.fraction) - self.allocated))
        return max(0, free)


def read_cuda_memory(device: int | torch.device | None = None) -> MemoryState:
    """``device``'s memory through ``torch.cuda`` (None: the current device)."""
    if device is None:
        device = torch.cuda.current_device()
    if not isinstance(device, torch.device):
        device = torch.device("cuda", int(device))
    free, total = torch.cuda.mem_get_info(device)
    return MemoryState(
        torch.cuda.memory_allocated(device),
        torch.cuda.memory_reserved(device),
        free,
        total,
        cuda_memory_fraction(device),
    )
