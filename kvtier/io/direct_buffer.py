"""Memory a store reads disk chunks straight into: the caller's view and the reads' own alias.

A read that lands in the caller's memory is only safe if a read given up on (a hung drive)
can never write there afterwards: it may sit in the kernel, or not have started yet, when
the caller gets its tensor back. So the memory is a memfd mapped twice. The caller's tensor
views one mapping; disk reads write through the other. Giving up on a read detaches the
caller's pages under it (``MAP_FIXED`` fresh anonymous pages at the same addresses): the late
read, wherever it is, writes into memory the caller no longer sees. A detached buffer is
never read into directly again (its caller pages are no longer the alias's).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvtier.io.buffers import PAGE, align_up

_MAP_FIXED = 0x10  # Linux; not in Python's mmap module before 3.13
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


class _Mapping(mmap.mmap):
    """The caller's mapping of a buffer's memfd (a subclass only to carry these fields)."""

    alias: np.ndarray  # the same memory mapped again, for reads
    address: int
    detached: bool


class DirectBuffer:
    """Page-aligned, pre-faulted memory mapped for a caller and for reads.

    ``array()`` is the caller's uint8 view (the memory lives as long as views of it do);
    ``alias`` the same bytes as reads see them (and write them). ``detach(ranges)`` cuts the
    caller's pages in ``ranges`` (byte offsets and lengths, page-aligned) loose from the
    alias, for good.
    """

    def __init__(self, mapping: _Mapping) -> None:
        self._caller = mapping
        self.size = len(mapping)
        self.alias = mapping.alias
        self.address = mapping.address

    def array(self) -> np.ndarray:
        return np.frombuffer(self._caller, dtype=np.uint8)

    @classmethod
    def allocate(cls, size: int) -> DirectBuffer:
        """A new buffer of ``size`` bytes (rounded up to a page)."""
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        size = align_up(size)
        fd = os.memfd_create("kvtier-direct", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            caller = _Mapping(fd, size, mmap.MAP_SHARED)
            alias = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mappings keep the memory
        for mapping in (caller, alias):
            try:
                mapping.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # kernels before 5.14
                np.frombuffer(mapping, dtype=np.uint8)[::PAGE] = 0
        caller.alias = np.frombuffer(alias, dtype=np.uint8)
        caller.address = np.frombuffer(caller, dtype=np.uint8).ctypes.data
        caller.detached = False
        return cls(caller)

    @property
    def detached(self) -> bool:
        return self._caller.detached

    def detach(self, ranges: list[tuple[int, int]]) -> None:
        """Give the caller fresh zero pages over ``ranges`` (page-aligned offset, length)."""
        self._caller.detached = True
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        for offset, length in ranges:
            if offset % PAGE or length % PAGE or offset + length > self.size:
                raise ValueError(f"range ({offset}, {length}) is not whole pages of the buffer")
            got = _libc.mmap(self.address + offset, length, prot, flags | _MAP_FIXED, -1, 0)
            if got != self.address + offset:
                err = ctypes.get_errno()
                # the late read would land in the caller's memory: nothing safe is left to do
                raise OSError(err, f"kvtier: cannot detach a buffer's pages: {os.strerror(err)}")


@dataclass(frozen=True)
class _Entry:
    start: int
    end: int
    mapping: weakref.ref[_Mapping]


class DirectBuffers:
    """The direct buffers one store made, found again from a tensor's address.

    A buffer stays registered while its memory lives (views of ``array`` hold it);
    ``find(address, nbytes)`` is the live buffer holding that whole byte range, if any. A
    buffer's death is noted without a lock (its weakref callback may run inside any
    allocation, with the lock held on the same thread) and handled at the next call.

    ``claim(address, nbytes)`` holds a byte range for one ``get``, waiting while another
    holds one that overlaps it: a get that gives up on a read detaches pages, which would
    wipe what a second get into the same bytes had already loaded there.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._dead: deque[int] = deque()  # start addresses of buffers freed, not yet forgotten
        self._claims: list[Rows] = []  # bytes gets hold
        self._claimed = threading.Condition(threading.Lock())
        # per tensor geometry, where its rows are (DirectTarget's cache; None: not readable into)
        self.geometry: dict[tuple, tuple[np.ndarray, int, int] | None] = {}

    def new(self, size: int) -> DirectBuffer:
        buffer = DirectBuffer.allocate(size)
        start = buffer.address
        freed = weakref.ref(buffer._caller, lambda _: self._dead.append(start))
        entry = _Entry(start, start + buffer.size, freed)
        with self._lock:
            self._forget_dead()
            self._entries[start] = entry
        return buffer

    def _forget_dead(self) -> None:
        """Drop the entries of buffers freed (lock held); their addresses may be reused."""
        while self._dead:
            start = self._dead.popleft()
            entry = self._entries.get(start)
            if entry is not None and entry.mapping() is None:
                del self._entries[start]
            self.geometry.clear()

    def find(self, address: int, nbytes: int) -> DirectBuffer | None:
        with self._lock:
            self._forget_dead()
            entries = list(self._entries.values())
        for entry in entries:
            if entry.start <= address and address + nbytes <= entry.end:
                mapping = entry.mapping()
                if mapping is not None:
                    return DirectBuffer(mapping)
        return None

    @contextmanager
    def claim(self, rows: Rows) -> Iterator[None]:
        """Hold the bytes of ``rows`` until the block ends, once no other claim overlaps
        them."""
        with self._claimed:
            while any(rows.overlaps(other) for other in self._claims):
                self._claimed.wait()
            self._claims.append(rows)
        try:
            yield
        finally:
            with self._claimed:
                self._claims.remove(rows)
                self._claimed.notify_all()


@dataclass(frozen=True)
class Rows:
    """Bytes as ``count`` rows of ``length`` bytes, ``stride`` bytes apart from ``start``
    (a tensor's ``(layer, K or V)`` rows; one row for any other bytes)."""

    start: int
    stride: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.length

    def overlaps(self, other: Rows) -> bool:
        """Whether any byte is in both (rows of other strides: whether their spans meet)."""
        if not (self.start < other.end and other.start < self.end):
            return False
        if self.stride != other.stride or max(self.length, other.length) > self.stride:
            return True
        q, r = divmod(other.start - self.start, self.stride)  # other's row j starts in row q + j
        for shift, meets in ((0, r < self.length), (1, r + other.length > self.stride)):
            if meets and max(0, -(q + shift)) < min(other.count, self.count - q - shift):
                return True
        return False
