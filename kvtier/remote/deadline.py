"""One overall deadline for a round trip to a store, over all its sends and receives.

A socket timeout bounds each receive: a store that answers a few bytes just inside it, again
and again, holds a round trip for as long as the value takes at that pace (minutes). Here a
thread opens a deadline (``bounded(seconds)``) around a round trip, and every socket made by
a ``DeadlineConnection`` (the redis-py connections of the remote tier and of ``kvtier
inspect``) gives each send and receive only the time left before it, and fails with
``TimeoutError`` once none is left: the round trip ends within its deadline, however the
store answers. Outside a deadline the sockets behave as plain ones.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.remote.resolve import RESOLVER, connect_host

_current = threading.local()  # .at: the monotonic time this thread's round trip must end by


@contextmanager
def bounded(seconds: float | None) -> Iterator[None]:
    """Within the block, this thread's deadline sockets end every send and receive by
    ``seconds`` from now (None: no deadline of its own); an outer deadline that ends sooner
    still holds."""
    outer = getattr(_current, "at", None)
    at = None if seconds is None else time.monotonic() + seconds
    if outer is not None and (at is None or outer < at):
        at = outer
    _current.at = at
    try:
        yield
    finally:
        _current.at = outer


def time_left() -> float | None:
    """Seconds left before this thread's deadline (0 once past it), or None without one."""
    at = getattr(_current, "at", None)
    return None if at is None else max(0.0, at - time.monotonic())


def expired() -> bool:
    """Whether this thread is inside a deadline that has passed."""
    return time_left() == 0.0


class DeadlineSocket:
    """A socket whose sends and receives end by the calling thread's deadline: each gets
    the smaller of the timeout set on it and the time left (``TimeoutError`` when none is).
    Everything else goes to the socket it wraps. ``received`` counts the bytes received on
    it, ``served`` the round trips that ended well on it (``pooled.PooledExchange``)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()  # what the connection asked for
        self.received = 0
        self.served = 0

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        left = time_left()
        if left is None:
            self._sock.settimeout(self._timeout)
            return
        if left <= 0.0:
            raise TimeoutError("the exchange with the store ran past its deadline")
        self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))

    def recv(self, *args: Any) -> bytes:
        self._arm()
        data: bytes = self._sock.recv(*args)
        if not (len(args) > 1 and args[1] & socket.MSG_PEEK):  # a peek reads nothing yet
            self.received += len(data)
        return data

    def recv_into(self, *args: Any) -> int:
        self._arm()
        n: int = self._sock.recv_into(*args)
        self.received += n
        return n

    def send(self, *args: Any) -> int:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()
        self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class DeadlineMixin:
    """Mixed into a redis-py connection class: its socket is a ``DeadlineSocket``, and its
    connect waits at most the time left too: the host name's lookup (``resolve.py``), the
    TCP connect, and a TLS connection's handshake after it (redis-py gives the handshake
    the connect timeout again)."""

    socket_connect_timeout: float | None
    socket_timeout: float | None
    socket_type: int
    host: str
    port: int

    def _connect(self) -> Any:
        host = getattr(self, "host", None)
        if not isinstance(host, str):  # a Unix socket's: nothing to resolve
            with self._connect_bounded():
                return DeadlineSocket(super()._connect())  # type: ignore[misc]
        with self._connect_bounded():
            addresses = RESOLVER.addresses(host, self.port, self.socket_type, self.socket_connect_timeout)
        failure: OSError | None = None
        for address in addresses:  # in the resolver's order, as redis-py tries them
            try:
                with self._connect_bounded(), self._literal(host, connect_host(address)):
                    return DeadlineSocket(super()._connect())  # type: ignore[misc]
            except OSError as exc:
                failure = exc
        raise failure or OSError(f"{host} resolved to no address")

    @contextmanager
    def _literal(self, name: str, address: str) -> Iterator[None]:
        """Within the block the connection's host is ``address`` (redis-py's lookup of it
        is then at once), its name kept for a TLS handshake (``_wrap_socket_with_ssl``)."""
        self.host, self._host_name = address, name
        try:
            yield
        finally:
            self.host = name

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        literal, self.host = self.host, getattr(self, "_host_name", self.host)  # the name
        try:  # the server's certificate is checked against
            return self._wrap_bounded(sock)
        finally:
            self.host = literal

    def _wrap_bounded(self, sock: Any) -> Any:
        with self._connect_bounded():
            if self.socket_connect_timeout is not None:  # (redis-py before 8.2 leaves the
                sock.settimeout(self.socket_connect_timeout)  # socket_timeout set for it)
            wrapped = super()._wrap_socket_with_ssl(sock)  # type: ignore[misc]
        wrapped.settimeout(self.socket_timeout)  # what the connection's receives ask for
        return wrapped

    @contextmanager
    def _connect_bounded(self) -> Iterator[None]:
        """Within the block the connect timeout is at most the time left now."""
        configured, left = self.socket_connect_timeout, time_left()
        if left is not None:
            if left <= 0.0:
                raise TimeoutError("the exchange with the store ran past its deadline")
            self.socket_connect_timeout = left if configured is None else min(left, configured)
        try:
            yield
        finally:
            self.socket_connect_timeout = configured


@functools.cache
def deadline_class(base: type) -> type:
    """``base`` (a redis-py connection class) with ``DeadlineMixin``."""
    return type(f"Deadline{base.__name__}", (DeadlineMixin, base), {})
