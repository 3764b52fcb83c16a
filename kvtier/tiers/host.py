"""The warm tier: slots cut from one page-aligned host buffer, pinned when CUDA is present."""

from __future__ import annotations

import os

import torch

from kvtier.errors import ConfigError
from kvtier.io.buffers import AlignedBuffer
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.units import format_size


class HostTier(MemoryTier):
    """Host memory slots. The same slots serve as O_DIRECT buffers for the disk tier."""

    name = TierName.HOST

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.buffer = AlignedBuffer(max(num_slots * slot_bytes, 1))
        self._whole = self.buffer.tensor()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def pinned(self) -> bool:
        return self.buffer.pinned

    def slot(self, index: int) -> torch.Tensor:
        self._check_index(index)
        start = index * self.slot_bytes
        return self._whole[start:start + self.slot_bytes]

    def slots(self, first: int, count: int) -> torch.Tensor:
        self._check_run(first, count)
        start = first * self.slot_bytes
        return self._whole[start:start + count * self.slot_bytes].view(count, self.slot_bytes)

    def slot_array(self, index: int):
        """Slot ``index`` as a numpy uint8 view (for I/O calls that take buffers)."""
        self._check_index(index)
        start = index * self.slot_bytes
        return self.buffer.array[start:start + self.slot_bytes]

    def close(self) -> None:
        self._whole = None
        self.buffer.close()


def physical_memory() -> int:
    """Bytes of memory the machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_host_tier(capacity: int, slot_bytes: int) -> HostTier:
    """The host tier for ``host_capacity=capacity``: ``ConfigError`` naming the key when the
    machine has less memory, or the allocation is refused (rather than a bare ENOMEM, or the
    OOM killer once the memory is touched)."""
    memory = physical_memory()
    if capacity > memory:
        raise ConfigError(f"kvtier config: host_capacity={format_size(capacity)} is more than "
                          f"this machine's {format_size(memory)} of memory; lower host_capacity")
    try:
        return HostTier(capacity // slot_bytes, slot_bytes)
    except (OSError, MemoryError) as exc:
        raise ConfigError(f"kvtier config: host_capacity={format_size(capacity)} could not be "
                          f"allocated ({exc}); lower host_capacity") from exc
