"""A slow store for the tests: a TCP proxy on 127.0.0.1 in front of a real server that
passes requests on at once and drips the answers back, ``piece`` bytes every ``pause``
seconds, so that every receive of a client ends well inside its socket timeout while a
large answer takes minutes. Every loop is bounded (``stop()``, a closed socket, or
``lifetime`` seconds per connection)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class DripProxy:
    def __init__(self, target_port: int, piece: int = 512, pause: float = 0.2,
                 lifetime: float = 60.0) -> None:
        self.target_port, self.piece, self.pause, self.lifetime = target_port, piece, pause, lifetime
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self.connections = 0
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
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
                dst.sendall(data)
                if piece:
                    time.sleep(self.pause)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)
        for s in self._sockets:
            s.close()
