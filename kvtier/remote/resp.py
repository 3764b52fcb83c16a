"""Reading a pipeline's GET and GETRANGE replies (RESP2 or RESP3 bulk strings and nulls) off
a socket straight into the caller's buffers: a value's header into a small buffer, its
payload (or the parts of it asked for) into the chunk's destination, with no copy and no
allocation the size of a chunk.

Every length is bounded by what was asked for: a reply of any other length (another
writer's value, a damaged one) is read through a small scratch buffer and answered as
``wrong length``, so the connection stays in step with its replies; one much longer than
asked (``SKIP_MAX``: a hostile writer's value of hundreds of MiB under a key) is not read
through within the round trip's deadline, at every read of it: ``TooLong`` says the
connection must be dropped.

What error replies say of where a request's keys live (a cluster's redirect and the node it
names, a replica, a store still loading) is kept by ``Refusals``, for every request.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

LINE_MAX = 4096  # the longest reply line read (an error message, a length)
SCRATCH = 1 << 20  # reading a value of a length not asked for, a piece at a time
SKIP_MAX = 8 << 20  # a value of a length not asked for is read through up to this much more


class RespError(Exception):
    """The stream is not RESP as expected: the connection must be dropped."""


class TooLong(RespError):
    """A value far longer than asked for: the reply is not read through (drop the
    connection); the value is no chunk of this tier's."""


class BulkReplies:
    """Replies read in order from ``sock`` (its timeout bounds every read)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(LINE_MAX)
        self._start = self._end = 0  # bytes read and not used yet: _buffer[_start:_end]

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            raise RespError("a reply line longer than expected")
        n = self._sock.recv_into(memoryview(self._buffer)[self._end:])
        if n == 0:
            raise ConnectionError("the store closed the connection")
        self._end += n

    def _line(self) -> bytes:
        while True:
            at = self._buffer.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buffer[self._start:at])
                self._start = at + 2
                return line
            if self._start:
                self._buffer[:self._end - self._start] = self._buffer[self._start:self._end]
                self._end -= self._start
                self._start = 0
            self._fill()

    def _read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: from what is buffered, then from the socket directly."""
        have = min(len(view), self._end - self._start)
        view[:have] = self._buffer[self._start:self._start + have]
        self._start += have
        done = have
        while done < len(view):
            n = self._sock.recv_into(view[done:])
            if n == 0:
                raise ConnectionError("the store closed the connection")
            done += n

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, SCRATCH)))
        while count:
            piece = min(count, len(scratch))
            self._read_into(scratch[:piece])
            count -= piece

    def line(self) -> bytes:
        """The next reply line (its type byte and what follows), without its CRLF."""
        return self._line()

    def body(self, length: int) -> bytes:
        """The ``length`` bytes of the bulk string whose line was just read (its CRLF read
        and checked)."""
        data = memoryview(bytearray(length + 2))
        self._read_into(data)
        if data[length:] != b"\r\n":
            raise RespError("a value not followed by CRLF")
        return bytes(data[:length])

    def bulk_into(self, *views: memoryview) -> str | None:
        """Read one GET or GETRANGE reply into ``views`` in turn when its length is theirs
        together: "" when it was, None when there is no such key (a null, or the empty
        string GETRANGE answers for a key that is not there: no kvtier value is empty), else
        what the reply was instead (an error, or ``wrong length``; its bytes are read and
        dropped)."""
        line = self._line()
        if line.startswith(b"-"):
            return line[1:].decode(errors="replace")
        if line == b"_":  # RESP3's null
            return None
        if not line.startswith(b"$"):
            raise RespError(f"unexpected reply {line[:40]!r}")
        try:
            length = int(line[1:])
        except ValueError:
            raise RespError(f"unexpected reply {line[:40]!r}") from None
        if length < 0:
            return None
        expected = sum(len(view) for view in views)
        if length == 0 and expected:
            self._skip(2)
            return None
        if length != expected:
            if length > expected + SKIP_MAX:
                raise TooLong(f"wrong length: a value of {length} bytes")
            self._skip(length + 2)
            return f"wrong length: a value of {length} bytes"
        for view in views:
            self._read_into(view)
        end = memoryview(bytearray(2))
        self._read_into(end)
        if end != b"\r\n":
            raise RespError("a value not followed by CRLF")
        return ""


ASKING = b"*1\r\n$6\r\nASKING\r\n"  # the next command is for a slot being imported here
Target = tuple[bool, str, int]  # where a redirect sends a key: (ASKING first, host, port)


def redirect_target(error: str) -> Target | None:
    """Where a ``MOVED`` or ``ASK`` reply (as ``bulk_into`` answers it) sends its key; None
    for any other reply (``TRYAGAIN`` names no node)."""
    kind, _, rest = error.partition(" ")
    host, _, port = rest.partition(" ")[2].rpartition(":")
    if kind not in ("MOVED", "ASK") or not host or not port.isdigit():
        return None
    return kind == "ASK", host, int(port)


class Refusals:
    """What the replies to a request (a ``pooled.Request``) said of where its keys live,
    set by its ``read`` (``note`` each error reply, after ``clear``): ``stale``, the slot
    map is out of date (``MOVED``, ``TRYAGAIN``; an ``ASK`` comes from the node the map
    names, its slot migrating); ``targets``, the position in the request of each key
    answered ``MOVED`` or ``ASK``, with where it lives; ``replica``, a reply said the
    connection reaches a replica (``READONLY``). ``asking``, set before ``send``: every
    command is sent after an ``ASKING`` (keys an ``ASK`` sent to this node). A ``LOADING``
    reply (the store still loading its data) fails the round trip: ``settle``, once every
    reply was read, raises it as redis-py raises it for the commands it reads. ``done``:
    the replies read so far, in order (a ``read`` that fails partway leaves there those of
    the commands before the failure, each whole and checked)."""

    asking = False

    def clear(self) -> None:
        self.stale = self.replica = False
        self.loading = ""
        self.targets: dict[int, Target] = {}
        self.done: list[Any] = []

    def settle(self) -> None:
        """Raise ``redis.exceptions.BusyLoadingError`` when a reply said ``LOADING``."""
        if self.loading:
            from redis.exceptions import BusyLoadingError

            raise BusyLoadingError(self.loading)

    def note(self, at: int, error: str) -> None:
        """The error reply (as ``bulk_into`` answers it) to the command at ``at``."""
        target = redirect_target(error)
        if target is not None:
            self.targets[at] = target
        self.stale |= error.startswith(("MOVED ", "TRYAGAIN "))
        self.replica |= error.startswith("READONLY ")
        if error.startswith("LOADING "):
            self.loading = error[len("LOADING "):]


def payload_view(dst: np.ndarray, nbytes: int) -> memoryview:
    """The first ``nbytes`` of ``dst`` as a writable byte view."""
    return dst.reshape(-1).view(np.uint8)[:nbytes].data.cast("B")
