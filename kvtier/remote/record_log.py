"""Reading a store's log of token records (a Valkey/Redis stream) with ``XRANGE``, the
reply read off the socket with bounds: each entry's key and record, whatever else a hostile
writer put there.

Every entry kvtier appends holds a chunk's key and its token record, which fits a slot
header (``token_record``): a few KiB. An entry larger than ``ENTRY_MAX`` (another client's,
of any size) is not read through, at every read of the log: it is passed over, named in
what the read answers, and the connection dropped; the next read goes on after it. A read
asks for ``COUNT_MAX`` entries at most, so a reply is read within ``resp.SKIP_MAX`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.io.format import HEADER_BYTES
from kvtier.remote.resp import ASKING, SKIP_MAX, BulkReplies, Refusals, RespError

ENTRY_MAX = 4 * HEADER_BYTES  # an entry's bytes in a reply at most: id, key, record, framing
COUNT_MAX = SKIP_MAX // ENTRY_MAX  # entries a read asks for at most
ID_MAX = 64  # a stream entry's id ("<ms>-<seq>") is at most 41 bytes
TOO_LARGE = (b"", b"")  # what an entry passed over as too large reads as: it names nothing


@dataclass(frozen=True)
class LogEntries:
    """What a read of the log found: ``last``, the id of the last entry read or passed over
    (the read's ``after`` when none); ``entries``, each entry's key and record (an entry
    without both fields left out, one too large as ``TOO_LARGE``); ``passed``, the id of
    the entry passed over as too large, if any (the read ended there)."""

    last: bytes
    entries: list[tuple[bytes, bytes]] = field(default_factory=list)
    passed: bytes | None = None


class LogRead(Refusals):
    """``XRANGE`` of the log at ``name`` after the entry ``after`` (b"0": from its oldest),
    ``count`` entries at most (``COUNT_MAX``); a ``pooled.Request`` whose reply is
    ``[LogEntries]``, or ``[error]`` when the store refused (a key of another type, a
    cluster's redirect). An entry too large drops the connection."""

    def __init__(self, name: bytes, after: bytes, count: int) -> None:
        self.name, self.after, self.count = name, after, max(1, min(count, COUNT_MAX))
        self.clear()

    def send(self, connection: Any) -> None:
        start = b"-" if self.after == b"0" else b"(" + self.after
        connection.send_packed_command([ASKING] * self.asking + connection.pack_command(
            "XRANGE", self.name, start, b"+", "COUNT", self.count), check_health=False)

    def read(self, connection: Any) -> list[LogEntries | str]:
        replies = BulkReplies(connection._sock)
        self.clear()
        if self.asking:
            replies.line()
        got = read_entries(replies, self.after, self.count)
        if isinstance(got, str):
            self.note(0, got)
            self.settle()
        if isinstance(got, LogEntries) and got.passed is not None:
            connection.disconnect()  # the rest of the reply not read
        return [got]


def read_entries(replies: BulkReplies, after: bytes, count: int) -> LogEntries | str:
    """An ``XRANGE`` reply of ``count`` entries at most, read with the bounds above; the
    store's error instead, as its text. ``RespError`` when it is not such a reply."""
    head = replies.line()
    if head.startswith(b"-"):
        return head[1:].decode(errors="replace")
    last, entries = after, list[tuple[bytes, bytes]]()
    for _ in range(_length(head, b"*", count)):
        if _length(replies.line(), b"*") != 2:
            raise RespError("a stream entry that is not (id, fields)")
        ident = _bulk(replies, ID_MAX)
        fields = _entry_fields(replies, ENTRY_MAX - len(ident))
        if fields is None:
            return LogEntries(ident, [*entries, TOO_LARGE], ident)
        last, key, record = ident, fields.get(b"k"), fields.get(b"r")
        if key is not None and record is not None:
            entries.append((key, record))
    return LogEntries(last, entries)


def _entry_fields(replies: BulkReplies, room: int) -> dict[bytes, bytes] | None:
    """An entry's fields (an array of names and values, or RESP3's map), or None when they
    take more than ``room`` bytes: the rest is not read."""
    head = replies.line()
    pairs = _length(head, b"%") if head.startswith(b"%") else _length(head, b"*") // 2
    fields: dict[bytes, bytes] = {}
    for _ in range(pairs):
        pair = []
        for _ in range(2):  # its name, then its value
            line = replies.line()
            length = _length(line, b"$")
            room -= len(line) + length + 4
            if room < 0:
                return None
            pair.append(replies.body(length))
        fields[pair[0]] = pair[1]
    return fields


def _bulk(replies: BulkReplies, limit: int) -> bytes:
    """A bulk string of at most ``limit`` bytes."""
    return replies.body(_length(replies.line(), b"$", limit))


def _length(line: bytes, kind: bytes, limit: int = 1 << 62) -> int:
    """The length a reply line of type ``kind`` gives (an array's items, a string's
    bytes); ``RespError`` for another line or a length outside 0 to ``limit``."""
    try:
        length = int(line[1:]) if line[:1] == kind else -1
    except ValueError:
        length = -1
    if not 0 <= length <= limit:
        raise RespError(f"unexpected reply {line[:40]!r} in a stream's entries")
    return length
