"""Page-aligned host memory allocated once, registered as pinned memory when CUDA is present.

One ``mmap`` gives memory aligned for O_DIRECT (4 KiB, and 2 MiB huge pages where the kernel
grants them: physically contiguous buffers make O_DIRECT and DMA faster). It is touched once at
allocation so that no first-touch page fault lands on a hot path.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def align_up(value: int, alignment: int = PAGE) -> int:
    return -(-value // alignment) * alignment


class AlignedBuffer:
    """``size`` bytes of page-aligned, pre-faulted memory; pinned for CUDA when possible.

    ``array`` is a numpy uint8 view and ``tensor()`` a torch uint8 view of the whole buffer;
    both share the memory, and stay valid until :meth:`close`.
    """

    def __init__(self, size: int, *, pin: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = align_up(size)
        self._mmap = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._prefault()
        self.address = self.array.ctypes.data
        self.pinned = pin and self._register_pinned()
        self._tensor = None

    def _prefault(self) -> None:
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # kernels before 5.14
            self.array[::PAGE] = 0

    def _register_pinned(self) -> bool:
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self.address, self.size, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %d bytes failed (error %s); host tier is "
                        "pageable, GPU copies will be slower", self.size, err)
            return False
        return True

    def tensor(self):  # -> torch.Tensor, kept untyped so this module imports without torch
        """The whole buffer as a torch uint8 tensor sharing memory (made once)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def close(self) -> None:
        """Unregister and unmap. Views made earlier must not be used afterwards."""
        if self._mmap.closed:
            return
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        self._tensor = None
        self.array = None  # type: ignore[assignment]  # closed: a later use fails at once
        try:
            self._mmap.close()
        except BufferError:
            log.debug("host buffer still viewed elsewhere; unmapped when the views go")
