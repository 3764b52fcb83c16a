"""The listening half of the tests' stand-in stores and proxies on 127.0.0.1
(``balancer.py``, ``drip_proxy.py``, ``resp_server.py``): a socket on a free loopback port,
an accept loop on a daemon thread that hands each connection to the subclass's
``accepted``, the threads it spawns, and ``stop()``, which ends the loop, closes the socket
and joins every thread. Every loop polls at 0.1 s, so ``stop()`` ends it soon."""

from __future__ import annotations

import socket
import threading
from typing import Self


class Loopback:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        """This listener as a Valkey/Redis server's address (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Self:
        """Accept connections from now on: each subclass's ``__init__`` ends with it, once its
        own state is set."""
        self._spawn(self._accept)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        """Take a connection a client opened (on the accept loop's thread)."""
        raise NotImplementedError
