"""``kvtier gc`` freeing slots of a writer's segment: only those whose index entry still
names the write gc chose, the segment's lock held, its log started afresh without them
first (readers following it forget them), then their index entries blanked and their space
punched out of the files (their headers blanked where holes cannot be punched)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from array import array
from collections.abc import MutableSequence

import numpy as np

from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, HeaderError, decode_header
from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.ops.cache import Segment, slot_file_sizes, slot_files
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.segments import hold, rewrite_log
from kvtier.segment.names import INDEX_FILE

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
BLOCK = 4096  # chosen slots looked at a time


def free_slots(segment: Segment, slots: np.ndarray, generations: np.ndarray,
               freed: MutableSequence[int]) -> str:
    """Free those of ``slots`` (each with the generation of the write gc chose there) whose
    index entry still names that write once the segment's lock is held (a writer may have
    opened the segment and written them again since gc read it): start the segment's log
    afresh without them (readers following it forget them first), blank their index
    entries, then punch their space out of the files (their headers blanked where holes
    cannot be punched). The index and slot files are all opened before anything changes,
    and the log is restarted next, so a file that cannot be written changes nothing
    (``OSError``). Each slot goes to ``freed`` once its index entry is blank (an error
    part-way leaves there what was done). Returns ``rewrite_log``'s problem ("" when the
    log was restarted, or there is none)."""
    stride, per_file = segment.meta.stride, segment.meta.file_slots
    with segment.open() as handle:
        lock = hold(handle, NamespaceClock(segment.ns))
        try:
            index, files = _open_for_writing(handle, set((slots // per_file).tolist()))
            try:
                still = _still_chosen(index, slots, generations)
                problem = rewrite_log(segment, handle, slot_file_sizes(segment.meta, handle), still)
                for slot in map(int, still):
                    os.pwrite(index, bytes(INDEX_ENTRY_BYTES), slot * INDEX_ENTRY_BYTES)
                    freed.append(slot)
                for slot in map(int, still):
                    _punch(files[slot // per_file], (slot % per_file) * stride, stride)
            finally:
                for fd in (index, *files.values()):
                    os.close(fd)
        finally:
            os.close(lock)
    return problem


def _still_chosen(index: int, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """Those of ``slots`` whose entry in the index (open as ``index``) still names the write
    of the generation chosen there, sorted (int64)."""
    order = np.argsort(slots, kind="stable")
    still = array("q")
    for first in range(0, len(order), BLOCK):  # (a block at a time as Python ints)
        block = order[first:first + BLOCK]
        for slot, generation in zip(slots[block].tolist(), generations[block].tolist(), strict=True):
            entry = os.pread(index, INDEX_ENTRY_BYTES, slot * INDEX_ENTRY_BYTES)
            try:
                if decode_header(entry).generation == generation:
                    still.append(slot)
            except HeaderError:
                continue
    return np.frombuffer(still, dtype=np.int64)


def _open_for_writing(directory: SafeDir, numbers: set[int]) -> tuple[int, dict[int, int]]:
    """Descriptors, opened for writing, of the index and of the slot files ``numbers`` (by
    number): all of them, or none (``OSError``)."""
    names = slot_files(directory)
    opened: list[int] = []
    try:
        opened.append(directory.open_file(INDEX_FILE, os.O_RDWR))
        for number in sorted(numbers):
            if number not in names:
                raise CacheDirError(errno.ENOENT, f"{directory.path}: slot file {number} is gone")
            opened.append(directory.open_file(names[number], os.O_RDWR))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened[0], dict(zip(sorted(numbers), opened[1:], strict=True))


def _punch(fd: int, offset: int, length: int) -> None:
    """Give ``length`` bytes at ``offset`` back to the filesystem (a hole); where holes
    cannot be made, blank the slot's header instead."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                       ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        os.pwrite(fd, bytes(HEADER_BYTES), offset)
