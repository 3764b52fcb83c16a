"""A small RESP3 server for the tests, on 127.0.0.1, standing in for a store with maintenance
notifications (Redis Software and Redis Cloud's "smart client handoffs"): it speaks enough
of the protocol for redis-py's handshake (``HELLO``, ``CLIENT SETINFO``, ``CLIENT
MAINT_NOTIFICATIONS``, ``SELECT``, ``PING``), keeps ``GET``, ``GETRANGE``, ``SET``,
``EXISTS`` and ``UNLINK`` in memory, and, as such a store does before a shard moves, sends a
``MIGRATING`` push to every connection that turned notifications on, just before the reply
to each of its commands. A connection that did not ask is sent no push. While ``loading``
is set, every command but the handshake's is answered ``LOADING``, as a store loading its
data after a restart answers.

Every loop is bounded (``stop()``, a closed socket, a short poll)."""

from __future__ import annotations

import contextlib
import socket

from tests.helpers.loopback import Loopback


class RespServer(Loopback):
    def __init__(self) -> None:
        super().__init__()
        self.values: dict[bytes, bytes] = {}
        self.pushes = 0  # pushes sent
        self.notified = 0  # connections that turned notifications on
        self.loading = False
        self.start()

    def url(self, query: str = "protocol=3") -> str:
        """This server's address with ``query`` (RESP3 unless told otherwise)."""
        return f"{super().url}?{query}"

    def _accepted(self, conn: socket.socket) -> None:
        self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        buffer, notify = bytearray(), [False]
        with conn:
            while not self._stop.is_set():
                command = _command(buffer)
                if command is None:
                    try:
                        data = conn.recv(1 << 16)
                    except TimeoutError:
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    buffer += data
                    continue
                with contextlib.suppress(OSError):
                    conn.sendall(self._answer(command, notify))

    def _answer(self, args: list[bytes], notify: list[bool]) -> bytes:
        name = b" ".join(a.upper() for a in args[:2])
        push = b""
        if notify[0]:
            with self._lock:
                self.pushes += 1
                push = b">3\r\n$9\r\nMIGRATING\r\n:%d\r\n:10\r\n" % self.pushes
        if name.startswith(b"HELLO"):
            return (b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.4.0\r\n"
                    b"$5\r\nproto\r\n:3\r\n")
        if name == b"CLIENT MAINT_NOTIFICATIONS":
            with self._lock:
                self.notified += 1
            notify[0] = True
            return b"+OK\r\n"
        return push + self._data(args)

    def _data(self, args: list[bytes]) -> bytes:
        verb = args[0].upper()
        with self._lock:
            if verb in (b"CLIENT", b"SELECT"):
                return b"+OK\r\n"
            if self.loading:
                return b"-LOADING Redis is loading the dataset in memory\r\n"
            if verb == b"PING":
                return b"+PONG\r\n"
            if verb == b"SET":
                self.values[args[1]] = args[2]
                return b"+OK\r\n"
            if verb in (b"EXISTS", b"UNLINK"):
                held = args[1] in self.values
                if verb == b"UNLINK":
                    self.values.pop(args[1], None)
                return b":%d\r\n" % held
            if verb in (b"GET", b"GETRANGE"):
                value = self.values.get(args[1])
                if value is not None and verb == b"GETRANGE":
                    value = value[int(args[2]):int(args[3]) + 1]
                return b"_\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        return b"-ERR unknown command\r\n"


def _command(buffer: bytearray) -> list[bytes] | None:
    """The first whole command in ``buffer`` (an array of bulk strings), taken out of it; None
    until one has come whole."""
    at = buffer.find(b"\r\n")
    if at < 0:
        return None
    count, pos, args = int(buffer[1:at]), at + 2, []
    for _ in range(count):
        end = buffer.find(b"\r\n", pos)
        if end < 0:
            return None
        length = int(buffer[pos + 1:end])
        if len(buffer) < end + 2 + length + 2:
            return None
        args.append(bytes(buffer[end + 2:end + 2 + length]))
        pos = end + 2 + length + 2
    del buffer[:pos]
    return args
