"""Pipelined GET, GETRANGE and SET written by hand on one connection to one server: every
command of a batch sent at once, each value read off the socket straight into its chunk's
buffer (``resp.BulkReplies``) or sent from it with no copy, and the replies read in order,
so that the connection stays in step with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.range_reads import RangeRead, failed_answer
from kvtier.remote.resp import BulkReplies, TooLong, payload_view
from kvtier.remote.values import ValueFormat


def get_into(connection: Any, form: ValueFormat, names: Sequence[bytes], keys: Sequence[ChunkKey],
             dsts: Sequence[np.ndarray]) -> list[IOResult]:
    """GET of each chunk (its value at ``names``), read into its ``dsts`` and checked."""
    connection.send_packed_command(
        [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names)],
        check_health=False)
    replies = BulkReplies(connection._sock)
    header = memoryview(bytearray(form.header_bytes))
    results: list[IOResult] = []
    for key, dst in zip(keys, dsts, strict=True):
        payload = payload_view(dst, form.raw_bytes)
        try:
            answer = replies.bulk_into(header, payload)
        except TooLong as exc:  # no chunk of ours: that key damaged, the rest not read (the
            connection.disconnect()  # connection dropped); no failure of the store's
            results.append(IOResult(IOStatus.CORRUPT, 0, str(exc)))
            not_read = IOResult(IOStatus.IO_ERROR, 0, "not read: the connection was dropped "
                                "after a value far longer than a chunk's")
            return results + [not_read] * (len(keys) - len(results))
        if answer is None:
            results.append(IOResult(IOStatus.MISSING))
        elif answer:
            results.append(failed_answer(answer))
        else:
            problem = form.problem(header, payload, key)
            results.append(IOResult(IOStatus.CORRUPT, 0, problem) if problem
                           else IOResult(IOStatus.OK, form.raw_bytes))
    return results


def ranges_into(connection: Any, plans: Sequence[RangeRead],
                names: Sequence[bytes]) -> list[IOResult]:
    """GETRANGE of each run of each plan (of the value at its name in ``names``), read into
    place; what each plan comes to."""
    command = b"".join(
        b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%d\r\n$%d\r\n%d\r\n"
        % (len(name), name, len(b"%d" % start), start, len(b"%d" % (end - 1)), end - 1)
        for plan, name in zip(plans, names, strict=True) for start, end, _ in plan.runs)
    connection.send_packed_command([command], check_health=False)
    replies = BulkReplies(connection._sock)
    return [plan.outcome([replies.bulk_into(*views) for _, _, views in plan.runs])
            for plan in plans]


def set_from(connection: Any, form: ValueFormat, names: Sequence[bytes],
             items: Sequence[tuple[ChunkKey, np.ndarray]]) -> list[Any]:
    """SET of each chunk at its name in ``names``, its bytes sent from the caller's buffer
    with no copy (the header goes before them as its own piece of the command); replies in
    order, as the client's pipeline answers them: True, or a refused one as its exception."""
    from redis.exceptions import ResponseError

    parts: list[bytes | memoryview] = []
    for (key, payload), name in zip(items, names, strict=True):
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                  % (len(name), name, form.header_bytes + raw.nbytes)
                  + form.header(key, raw), raw.data, b"\r\n"]
    connection.send_packed_command(parts, check_health=False)
    replies: list[Any] = []
    for _ in items:
        try:
            replies.append(connection.read_response())
        except ResponseError as refused:  # read whole: the connection stays in step
            replies.append(refused)
    return [True if r == b"OK" else r for r in replies]
