"""A slow store for the tests: a TCP proxy on 127.0.0.1 in front of a real server that
passes requests on at once and drips the answers back, ``piece`` bytes every ``pause``
seconds, so that every receive of a client ends well inside its socket timeout while a
large answer takes minutes. Every loop is bounded (``stop()``, a closed socket, or
``lifetime`` seconds per connection). ``answered`` counts the answer bytes passed on, over
every connection; once ``stall_after`` is set, no byte past that count is passed on (a
store that stops answering partway through a reply)."""

from __future__ import annotations

import contextlib
import socket
import time

from tests.helpers.loopback import Loopback


class DripProxy(Loopback):
    def __init__(self, target_port: int, piece: int = 512, pause: float = 0.2,
                 lifetime: float = 60.0) -> None:
        super().__init__()
        self.target_port, self.piece, self.pause, self.lifetime = target_port, piece, pause, lifetime
        self._sockets: list[socket.socket] = []
        self.connections = 0
        self.answered = 0
        self.stall_after: int | None = None
        self.start()

    def _accepted(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        self._sockets += [client, server]
        self.connections += 1
        ends = time.monotonic() + self.lifetime
        self._spawn(self._relay, client, server, ends, None)  # requests: at once
        self._spawn(self._relay, server, client, ends, self.piece)  # answers: dripped

    def _relay(self, src: socket.socket, dst: socket.socket, ends: float,
               piece: int | None) -> None:
        src.settimeout(0.1)
        try:
            while not self._stop.is_set() and time.monotonic() < ends:
                try:
                    data = src.recv(piece or 1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                if piece:
                    data = self._passed(data)
                dst.sendall(data)
                if piece:
                    time.sleep(self.pause)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _passed(self, data: bytes) -> bytes:
        """What of an answer's ``data`` is passed on: all of it, or up to ``stall_after``."""
        with self._lock:
            if self.stall_after is not None:
                data = data[:max(0, self.stall_after - self.answered)]
            self.answered += len(data)
        return data

    def stop(self) -> None:
        super().stop()
        for s in self._sockets:
            s.close()
