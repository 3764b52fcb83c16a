"""Fault in the pages a copy is about to write, before it writes them.

A copy into fresh memory (a new ``torch.empty``) takes a page fault per 4 KiB page it
writes: a trap, then the kernel allocates and zeroes the page. ``MADV_POPULATE_WRITE``
(Linux 5.14) allocates and zeroes the same pages in one call, with no trap per page; the copy
that follows then runs as fast as into memory written before. Nothing is written: the bytes
stay what they were (zeros for fresh memory), so populating is safe over bytes another thread
writes meanwhile.

``populate(view)`` populates the pages under ``view``'s elements (a numpy array or a torch
tensor, any strides): its rows of contiguous bytes, whole pages, neighbours merged; the pages
between rows only when the rows are too many or too small to name one by one. It returns what
it did (``Populated``), never raises for want of support, and is a no-op for memory already
resident (the first, middle and last page of the span are checked with ``mincore``: a
reused tensor costs three system calls, not a walk of its page tables), for memory not in
this process (a tensor on a device), and on a kernel without ``MADV_POPULATE_WRITE``, where
touching the pages first from one thread costs what the copy's own faults do (nothing to
gain). A page only ever read maps the shared zero page and counts as resident: a write to
it still faults.

``populating(chunks)`` wraps a function that returns the view of chunks ``i`` to ``i + n - 1``
of a destination, populating each view it returns: a copy into it, then, does not fault.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

import numpy as np

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python's mmap module before 3.12
MAX_SPANS = 4096  # past this many rows, the span from the first to the last is populated

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

View = TypeVar("View")


class Populated(Enum):
    POPULATED = "populated"  # the pages were faulted in
    RESIDENT = "resident"  # they already were: nothing done
    EMPTY = "empty"  # no bytes
    NOT_HERE = "not_here"  # not memory of this process (a device tensor)
    UNSUPPORTED = "unsupported"  # the kernel has no MADV_POPULATE_WRITE
    FAILED = "failed"  # the kernel refused these pages (a special mapping): left to the copy


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)``: 0, or the error number."""
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def resident(address: int) -> bool:
    """Whether the page at ``address`` (page-aligned) is in memory (``mincore(2)``)."""
    vec = ctypes.c_ubyte(0)
    if _libc.mincore(address, PAGE, ctypes.byref(vec)) != 0:
        return False  # not mapped: populating will say so
    return bool(vec.value & 1)


class _Support:
    """Whether this kernel has ``MADV_POPULATE_WRITE``: asked once, of a page of our own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: bool | None = None

    def __call__(self) -> bool:
        with self._lock:
            if self._known is None:
                probe = ctypes.create_string_buffer(2 * PAGE)
                page = -(-ctypes.addressof(probe) // PAGE) * PAGE
                self._known = madvise(page, PAGE, MADV_POPULATE_WRITE) != errno.EINVAL
            return self._known


supported = _Support()


def populate(view: Any) -> Populated:
    """Fault in the pages under ``view``'s elements (module docstring)."""
    spans = page_spans(view)
    if spans is None:
        return Populated.NOT_HERE
    if not len(spans):
        return Populated.EMPTY
    middle = spans[len(spans) // 2].sum() // 2 // PAGE * PAGE
    if all(resident(int(a)) for a in (spans[0, 0], middle, spans[-1, 1] - PAGE)):
        return Populated.RESIDENT
    if not supported():
        return Populated.UNSUPPORTED
    for start, end in spans.tolist():
        if madvise(start, end - start, MADV_POPULATE_WRITE):
            return Populated.FAILED
    return Populated.POPULATED


def populating(chunks: Callable[[int, int], View]) -> Callable[[int, int], View]:
    """``chunks``, each view it returns populated first."""
    def populated(first: int, count: int) -> View:
        view = chunks(first, count)
        populate(view)
        return view
    return populated


def page_spans(view: Any) -> np.ndarray | None:
    """``(start, end)`` addresses of the whole pages under ``view``'s elements, sorted, apart
    from one another, at most ``MAX_SPANS`` of them; None for memory not in this process."""
    geometry = _geometry(view)
    if geometry is None:
        return None
    address, shape, strides, item = geometry
    if 0 in shape:
        return np.empty((0, 2), dtype=np.int64)
    dims = sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n > 1)
    block = item  # the innermost dimensions that lie end to end are one contiguous block
    while dims and dims[0][0] == block:
        block *= dims.pop(0)[1]
    low = address + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    starts = np.zeros(1, dtype=np.int64)
    for stride, n in dims:
        if starts.size * n > MAX_SPANS:
            high = low + sum((m - 1) * abs(s) for m, s in zip(shape, strides, strict=True)) + item
            return _pages(np.array([[low, high]], dtype=np.int64))
        starts = np.add.outer(starts, np.arange(n, dtype=np.int64) * stride).reshape(-1)
    starts = np.sort(starts) + low
    return _pages(np.stack([starts, starts + block], axis=1))


def _pages(spans: np.ndarray) -> np.ndarray:
    """``spans`` (sorted by start) widened to whole pages, those that touch merged."""
    starts, ends = spans[:, 0] // PAGE * PAGE, -(-spans[:, 1] // PAGE) * PAGE
    ends = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > ends[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return np.stack([starts[first], ends[last]], axis=1)


def _geometry(view: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int] | None:
    """(address of element 0, shape, strides in bytes, element size) of a numpy array or a
    CPU torch tensor; None for a tensor elsewhere."""
    if isinstance(view, np.ndarray):
        return (view.__array_interface__["data"][0], view.shape, view.strides, view.itemsize)
    if view.device.type != "cpu":
        return None
    item = view.element_size()
    return (view.data_ptr(), tuple(view.shape), tuple(s * item for s in view.stride()), item)
