"""Pipelined requests written by hand on one connection (a server's, or a cluster node's),
each a ``pooled.Request``: every command sent at once, the replies read in order, so that
the connection stays in step with them. GET and GETRANGE read each value off the socket
straight into its chunk's buffer (``resp.BulkReplies``), SET sends it from there with no
copy; other commands' replies are read by the client's parser."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.range_reads import RangeRead, failed_answer
from kvtier.remote.resp import BulkReplies, TooLong, payload_view, redirect
from kvtier.remote.values import ValueFormat


class Gets:
    """GET of each chunk (its value at ``names``), read into its ``dsts`` and checked: one
    ``IOResult`` each. A value far longer than a chunk's (``TooLong``) is CORRUPT, the
    connection dropped and the chunks after it not read (IO_ERROR): no failure of the
    store's."""

    def __init__(self, form: ValueFormat, names: Sequence[bytes], keys: Sequence[ChunkKey],
                 dsts: Sequence[np.ndarray]) -> None:
        self.form, self.names, self.keys, self.dsts = form, names, keys, dsts
        self.redirected = self.replica = False

    def send(self, connection: Any) -> None:
        connection.send_packed_command(
            [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in self.names)],
            check_health=False)

    def read(self, connection: Any) -> list[IOResult]:
        replies, self.redirected = BulkReplies(connection._sock), False
        header = memoryview(bytearray(self.form.header_bytes))
        results: list[IOResult] = []
        for key, dst in zip(self.keys, self.dsts, strict=True):
            payload = payload_view(dst, self.form.raw_bytes)
            try:
                answer = replies.bulk_into(header, payload)
            except TooLong as exc:  # no chunk of ours: that key damaged, the rest not read
                connection.disconnect()  # (the connection dropped); no failure of the store's
                results.append(IOResult(IOStatus.CORRUPT, 0, str(exc)))
                not_read = IOResult(IOStatus.IO_ERROR, 0, "not read: the connection was dropped "
                                    "after a value far longer than a chunk's")
                return results + [not_read] * (len(self.keys) - len(results))
            if answer is None:
                results.append(IOResult(IOStatus.MISSING))
            elif answer:
                self.redirected |= redirect(answer)
                results.append(failed_answer(answer))
            else:
                problem = self.form.problem(header, payload, key)
                results.append(IOResult(IOStatus.CORRUPT, 0, problem) if problem
                               else IOResult(IOStatus.OK, self.form.raw_bytes))
        return results


class Ranges:
    """GETRANGE of each run of each plan (of the value at its name in ``names``), read into
    place: what each plan comes to."""

    def __init__(self, plans: Sequence[RangeRead], names: Sequence[bytes]) -> None:
        self.plans, self.names = plans, names
        self.redirected = self.replica = False

    def send(self, connection: Any) -> None:
        command = b"".join(
            b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%d\r\n$%d\r\n%d\r\n"
            % (len(name), name, len(b"%d" % start), start, len(b"%d" % (end - 1)), end - 1)
            for plan, name in zip(self.plans, self.names, strict=True)
            for start, end, _ in plan.runs)
        connection.send_packed_command([command], check_health=False)

    def read(self, connection: Any) -> list[IOResult]:
        replies, self.redirected = BulkReplies(connection._sock), False
        results = []
        for plan in self.plans:
            answers = [replies.bulk_into(*views) for _, _, views in plan.runs]
            self.redirected |= any(redirect(a) for a in answers if a)
            results.append(plan.outcome(answers))
        return results


class Sets:
    """SET of each chunk at its name in ``names``, its bytes sent from the caller's buffer
    with no copy (the header goes before them as its own piece of the command); replies in
    order: True, or a refused one as its exception. A SET may be sent twice: a chunk's
    value is the same whoever writes it."""

    def __init__(self, form: ValueFormat, names: Sequence[bytes],
                 items: Sequence[tuple[ChunkKey, np.ndarray]]) -> None:
        self.form, self.names, self.items = form, names, items
        self.redirected = self.replica = False

    def send(self, connection: Any) -> None:
        parts: list[bytes | memoryview] = []
        for (key, payload), name in zip(self.items, self.names, strict=True):
            raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                      % (len(name), name, self.form.header_bytes + raw.nbytes)
                      + self.form.header(key, raw), raw.data, b"\r\n"]
        connection.send_packed_command(parts, check_health=False)

    def read(self, connection: Any) -> list[Any]:
        replies = read_replies(connection, len(self.items))
        self.redirected, self.replica = refusals(replies)
        return [True if r == b"OK" else r for r in replies]


class Commands:
    """``commands`` (name, args), their replies as the client's parser reads them (a
    refused command as its exception)."""

    def __init__(self, commands: Sequence[tuple[str, tuple]]) -> None:
        self.commands = commands
        self.redirected = self.replica = False

    def send(self, connection: Any) -> None:
        connection.send_packed_command(connection.pack_commands(
            [(name.upper(), *args) for name, args in self.commands]), check_health=False)

    def read(self, connection: Any) -> list[Any]:
        replies = read_replies(connection, len(self.commands))
        self.redirected, self.replica = refusals(replies)
        return replies


def read_replies(connection: Any, count: int) -> list[Any]:
    """The next ``count`` replies, read whole: a refused command's as its exception (the
    connection stays in step)."""
    from redis.exceptions import ResponseError

    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except ResponseError as refused:
            replies.append(refused)
    return replies


def refusals(replies: Sequence[Any]) -> tuple[bool, bool]:
    """Whether any of ``replies`` (as the client's parser reads them) is a cluster's
    redirect, and whether any says the connection reaches a replica (``READONLY``)."""
    from redis.exceptions import AskError, MovedError, ReadOnlyError, TryAgainError

    return (any(isinstance(r, MovedError | AskError | TryAgainError) for r in replies),
            any(isinstance(r, ReadOnlyError) for r in replies))
