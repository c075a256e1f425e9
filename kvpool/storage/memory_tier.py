"""Memory tiers: the DRAM arena and GPU memory, each carved by an ExtentAllocator.

A memory tier owns one contiguous backing buffer for its whole life and only
hands out slices of it, so a put never allocates from the heap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.bindings.buffers import Region, region_nbytes
from kvpool.errors import TierUnavailableError
from kvpool.eviction import EvictionPolicy
from kvpool.storage.allocator import ExtentAllocator
from kvpool.storage.arena import SharedArena


class MemoryTier:
    """A fixed buffer (numpy view of host memory, or a CUDA uint8 tensor) plus allocator."""

    def __init__(self, name: str, buffer: Region, policy: EvictionPolicy, alignment: int) -> None:
        self.name = name
        self.buffer = buffer
        # host memory as a memoryview, for small copies by slice assignment (None: device)
        self.host_bytes: memoryview | None = None
        if isinstance(buffer, np.ndarray):
            self.host_bytes = memoryview(buffer)  # type: ignore[arg-type]
        self.policy = policy
        self.allocator = ExtentAllocator(region_nbytes(buffer), alignment)
        self.capacity = self.allocator.capacity

    def region(self, offset: int, size: int) -> Region:
        """Zero-copy slice [offset, offset+size) of the backing buffer."""
        return self.buffer[offset : offset + size]

    def fits(self, size: int) -> bool:
        return self.allocator.round_up(size) <= self.capacity

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def close(self) -> None:
        """Let go of the backing buffer. Not an empty slice of it: a view keeps its
        whole base alive (the GPU tier's device memory, the DRAM arena's mapping)."""
        if self.host_bytes is not None:
            self.host_bytes.release()
            self.host_bytes = None
        empty = self.buffer[:0]
        self.buffer = empty.copy() if isinstance(empty, np.ndarray) else empty.clone()


class DramTier(MemoryTier):
    """The pool's main tier: a pre-faulted shared-memory arena (page-locked under CUDA;
    ``page_lock`` says whether that happened, and why not)."""

    def __init__(
        self, size: int, policy: EvictionPolicy, alignment: int, *, page_lock: bool = True
    ) -> None:
        self.arena = SharedArena(size, page_lock=page_lock)
        super().__init__("dram", self.arena.view, policy, alignment)

    @property
    def page_lock(self) -> str:
        """The arena's CUDA registration status (``kvpool.storage.page_lock``)."""
        return self.arena.page_lock.status

    def close(self) -> None:
        super().close()
        self.arena.close()


class GpuTier(MemoryTier):
    """Device memory on the current CUDA device; only where CUDA is present."""

    def __init__(self, size: int, policy: EvictionPolicy, alignment: int) -> None:
        super().__init__("gpu", _cuda_buffer(size), policy, alignment)


def _cuda_buffer(size: int) -> Any:
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        raise TierUnavailableError(
            f"gpu_bytes={size} asks for a GPU tier, but CUDA is not available here "
            "(torch.cuda.is_available() is False); pass gpu_bytes=0"
        )
    return torch.empty(size, dtype=torch.uint8, device="cuda")
