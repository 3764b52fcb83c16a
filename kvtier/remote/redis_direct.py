"""Pipelined requests written by hand on one connection (a server's, or a cluster node's),
each a ``pooled.Request``: every command sent at once, the replies read in order, so that
the connection stays in step with them. GET and GETRANGE read each value off the socket
straight into its chunk's buffer (``resp.BulkReplies``), SET sends it from there with no
copy; other commands' replies are read by the client's parser. Each says what its replies
said of where its keys live (``resp.Refusals``), and with ``asking`` set sends each of its
commands after an ``ASKING`` (its reply read and dropped: a refused one leaves the command
answered ``ASK`` again)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.range_reads import RangeRead, failed_answer
from kvtier.remote.resp import ASKING, BulkReplies, Refusals, TooLong, payload_view
from kvtier.remote.values import ValueFormat


class Gets(Refusals):
    """GET of each chunk (its value at ``names``), read into its ``dsts`` and checked: one
    ``IOResult`` each. A value far longer than a chunk's (``TooLong``) is CORRUPT, the
    connection dropped and the chunks after it not read (IO_ERROR): no failure of the
    store's."""

    def __init__(self, form: ValueFormat, names: Sequence[bytes], keys: Sequence[ChunkKey],
                 dsts: Sequence[np.ndarray]) -> None:
        self.form, self.names, self.keys, self.dsts = form, names, keys, dsts
        self.clear()

    def send(self, connection: Any) -> None:
        ask = ASKING if self.asking else b""
        connection.send_packed_command([b"".join(
            ask + b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in self.names)],
            check_health=False)

    def read(self, connection: Any) -> list[IOResult]:
        replies = BulkReplies(connection._sock)
        self.clear()
        header = memoryview(bytearray(self.form.header_bytes))
        results: list[IOResult] = self.done
        for key, dst in zip(self.keys, self.dsts, strict=True):
            payload = payload_view(dst, self.form.raw_bytes)
            if self.asking:
                replies.line()
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
                self.note(len(results), answer)
                results.append(failed_answer(answer))
            else:
                problem = self.form.problem(header, payload, key)
                results.append(IOResult(IOStatus.CORRUPT, 0, problem) if problem
                               else IOResult(IOStatus.OK, self.form.raw_bytes))
        self.settle()
        return results


class Ranges(Refusals):
    """GETRANGE of each run of each plan (of the value at its name in ``names``), read into
    place: what each plan comes to."""

    def __init__(self, plans: Sequence[RangeRead], names: Sequence[bytes]) -> None:
        self.plans, self.names = plans, names
        self.clear()

    def send(self, connection: Any) -> None:
        command = b"".join(
            (ASKING if self.asking else b"")
            + b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%d\r\n$%d\r\n%d\r\n"
            % (len(name), name, len(b"%d" % start), start, len(b"%d" % (end - 1)), end - 1)
            for plan, name in zip(self.plans, self.names, strict=True)
            for start, end, _ in plan.runs)
        connection.send_packed_command([command], check_health=False)

    def read(self, connection: Any) -> list[IOResult]:
        replies = BulkReplies(connection._sock)
        self.clear()
        results: list[IOResult] = self.done
        for at, plan in enumerate(self.plans):
            answers = []
            for _, _, views in plan.runs:
                if self.asking:
                    replies.line()
                answers.append(replies.bulk_into(*views))
            for answer in filter(None, answers):
                self.note(at, answer)
            results.append(plan.outcome(answers))
        self.settle()
        return results


class Sets(Refusals):
    """SET of each chunk at its name in ``names``, its bytes sent from the caller's buffer
    with no copy (the header goes before them as its own piece of the command); replies in
    order: True, or a refused one as its exception. A SET may be sent twice: a chunk's
    value is the same whoever writes it."""

    def __init__(self, form: ValueFormat, names: Sequence[bytes],
                 items: Sequence[tuple[ChunkKey, np.ndarray]]) -> None:
        self.form, self.names, self.items = form, names, items
        self.clear()

    def send(self, connection: Any) -> None:
        parts: list[bytes | memoryview] = []
        ask = ASKING if self.asking else b""
        for (key, payload), name in zip(self.items, self.names, strict=True):
            raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
            parts += [ask + b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                      % (len(name), name, self.form.header_bytes + raw.nbytes)
                      + self.form.header(key, raw), raw.data, b"\r\n"]
        connection.send_packed_command(parts, check_health=False)

    def read(self, connection: Any) -> list[Any]:
        return read_replies(self, connection, len(self.items), _stored)


class Commands(Refusals):
    """``commands`` (name, args), their replies as the client's parser reads them (a
    refused command as its exception)."""

    def __init__(self, commands: Sequence[tuple[str, tuple]]) -> None:
        self.commands = commands
        self.clear()

    def send(self, connection: Any) -> None:
        asking = [("ASKING",)] if self.asking else []
        connection.send_packed_command(connection.pack_commands(
            [c for name, args in self.commands for c in (*asking, (name.upper(), *args))]),
            check_health=False)

    def read(self, connection: Any) -> list[Any]:
        return read_replies(self, connection, len(self.commands))


def _stored(reply: Any) -> Any:
    """A SET's reply as ``Sets`` answers it: True once stored."""
    return True if reply == b"OK" else reply


def read_replies(request: Refusals, connection: Any, count: int,
                 answer: Callable[[Any], Any] = lambda reply: reply) -> list[Any]:
    """The next ``count`` replies to ``request``'s commands (an ``ASKING``'s before each
    dropped), read whole, each as ``answer`` makes it: a refused command's as its
    exception (the connection stays in step), noted in ``request``."""
    from redis.exceptions import ResponseError

    request.clear()
    replies = request.done
    for _ in range(count):
        if request.asking:
            with contextlib.suppress(ResponseError):
                connection.read_response()
        try:
            replies.append(answer(connection.read_response()))
        except ResponseError as refused:
            request.note(len(replies), error_text(refused))
            replies.append(refused)
    return replies


def error_text(refused: Any) -> str:
    """A refusal the client's parser read, as ``resp.BulkReplies`` answers it: its error
    code first (redis-py leaves a redirect's out)."""
    from redis.exceptions import AskError, MovedError, ReadOnlyError, TryAgainError

    for kind, code in ((MovedError, "MOVED"), (AskError, "ASK"), (TryAgainError, "TRYAGAIN"),
                       (ReadOnlyError, "READONLY")):
        if isinstance(refused, kind):
            return f"{code} {refused}"
    return str(refused)
