"""What every memory tier provides: fixed-size slots that torch can view."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum

import torch


class TierName(StrEnum):
    """The tiers, hottest first."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"  # other writers' segments of a shared directory: read, never written
    REMOTE = "remote"  # a distributed store beyond this machine (kvtier.remote)


class MemoryTier(ABC):
    """``num_slots`` slots of ``slot_bytes`` bytes each, in one memory region.

    Contract (checked by ``tests/test_memory_tiers.py`` for every implementation):

    - ``slot(i)`` is a contiguous uint8 tensor of exactly ``slot_bytes`` bytes on ``device``,
      a view (writing it writes the tier), distinct slots never overlap, and it stays valid
      until ``close()``.
    - ``slots(first, count)`` is a ``(count, slot_bytes)`` uint8 view of the slots ``first``
      to ``first + count - 1``, in order (row ``j`` is ``slot(first + j)``): one copy can
      fill them all.
    - ``slot_bytes`` is a multiple of 4096 and host-memory slots start on a 4096-byte page
      (device slots on the device allocator's alignment).
    - The region is allocated once, at construction: no allocation per chunk.
    - ``close()`` releases the memory; it may be called twice.
    """

    name: TierName

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 0 or slot_bytes <= 0 or slot_bytes % 4096:
            raise ValueError(
                f"{type(self).__name__}: need num_slots >= 0 and slot_bytes a positive "
                f"multiple of 4096, got {num_slots} x {slot_bytes}"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def slot(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def slots(self, first: int, count: int) -> torch.Tensor: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def _check_run(self, first: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"{self.name} slots: need a count of at least 1, got {count}")
        self._check_index(first)
        self._check_index(first + count - 1)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"{self.name} slot {index} out of range 0..{self.num_slots - 1}")
