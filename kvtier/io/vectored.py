"""Vectored reads and writes carried to their end.

One ``preadv``/``pwritev`` may move fewer bytes than asked and still succeed: Linux moves at
most ``MAX_CALL_BYTES`` in one call, and a network or FUSE filesystem may stop short of the
end of a file. ``read_fully`` and ``write_fully`` call again from where the last call
stopped, so a short count means the end of the file (a read) or a failure (a write), never a
call that merely stopped early. Callers still bound a run of slots to ``RUN_BYTES``, so one
call normally does it all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

MAX_CALL_BYTES = 0x7FFFF000  # the most one read or write moves on Linux (2 GiB - 4 KiB)
RUN_BYTES = 1 << 30  # the most a run of neighbouring slots asks of one vectored call


def read_fully(fd: int, iov: Sequence[object], offset: int) -> int:
    """Read ``iov`` from ``offset`` of ``fd``, calling again after a short read until every
    buffer is full or the file ends; the bytes read."""
    return _fully(os.preadv, fd, iov, offset)


def write_fully(fd: int, iov: Sequence[object], offset: int) -> int:
    """Write ``iov`` at ``offset`` of ``fd``, calling again after a short write until all of
    it is written or a call writes nothing; the bytes written (an ``OSError`` raises)."""
    return _fully(os.pwritev, fd, iov, offset)


def _fully(call: Callable[[int, list[memoryview], int], int], fd: int, iov: Sequence[object],
           offset: int) -> int:
    views = [memoryview(cast("Buffer", b)).cast("B") for b in iov]
    wanted, done = sum(v.nbytes for v in views), 0
    while views:
        got = call(fd, views, offset + done)
        if got <= 0:
            break
        done += got
        if done >= wanted:
            break
        views = _past(views, got)
    return done


def _past(views: list[memoryview], count: int) -> list[memoryview]:
    """``views`` without their first ``count`` bytes."""
    for i, view in enumerate(views):
        if count < view.nbytes:
            return [view[count:], *views[i + 1:]]
        count -= view.nbytes
    return []
