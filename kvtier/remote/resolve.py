"""Host names resolved within a deadline.

``socket.getaddrinfo`` takes no timeout: a resolver that does not answer holds the calling
thread for its own timeouts and retries (5 s a try by default, several tries and servers),
and a round trip that connects anew (a store restarted, a pooled connection reset) would
hold a step of vLLM that long, whatever ``remote_timeout`` says. Here a lookup runs on a
thread of its own while its caller waits at most ``timeout_s`` (``TimeoutError`` then, the
lookup left to end); concurrent lookups of one name share one thread. An answer is kept for
``TTL_S``; past that it is still the answer, at once, while the name is looked up again in
the background (a store is not out of service because its DNS is). A literal address is
its own answer.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.io.guarded import submit_guarded

TTL_S = 30.0  # how long an answer is used before the name is looked up again
Address = tuple  # (family, type, proto, canonname, sockaddr), as getaddrinfo gives them
_Name = tuple[str, int, int]  # (host, port, family)


class Resolver:
    """``getaddrinfo`` for stream sockets, each lookup bounded by its caller's wait."""

    def __init__(self, threads: int = 4,
                 lookup: Callable[[str, int, int, int], list[Address]] | None = None) -> None:
        self._lookup_fn = lookup  # None: socket.getaddrinfo
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made on first use: none at import
        self._threads = threads
        self._answers: dict[_Name, tuple[float, list[Address]]] = {}  # name: (when, answer)
        self._asking: dict[_Name, Future] = {}

    def addresses(self, host: str, port: int, family: int, timeout_s: float | None) -> list[Address]:
        """The addresses of ``host`` (a literal address is its own answer, at once), or
        ``TimeoutError`` when the resolver gave none within ``timeout_s`` (None: no bound)
        and none was kept, or the resolver's ``OSError`` (``socket.gaierror``). An answer
        kept past ``TTL_S`` is the answer at once while the name is looked up again."""
        if _literal(host):
            return socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
        name = (host, port, family)
        with self._lock:
            kept = self._answers.get(name)
            future = self._asking.get(name)
            if future is None and (kept is None or time.monotonic() - kept[0] >= TTL_S):
                future = self._ask(name)
            if kept is not None:
                return kept[1]  # (stale while asked again: a store is not down with its DNS)
        assert future is not None
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:  # (a TimeoutError: the resolver's own OSErrors pass as they are)
            raise TimeoutError(f"resolving {host} took longer than {timeout_s:g} s: the "
                               "resolver did not answer (check the DNS servers)") from None

    def _ask(self, name: _Name) -> Future:
        """Start a lookup of ``name`` (the lock held)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, "kvtier-resolve")
        future: Future = Future()
        self._asking[name] = future
        try:
            submit_guarded(self._pool, self._lookup, name, future=future)
        except RuntimeError as exc:  # no thread could start: this lookup fails
            del self._asking[name]
            failed: Future = Future()
            failed.set_exception(OSError(f"resolving {name[0]}: no thread to look it up ({exc})"))
            return failed
        return future

    def after_fork(self) -> None:
        """In a child process: the parent's lookup threads are not there."""
        self._lock = threading.Lock()
        self._pool, self._asking = None, {}

    def _lookup(self, name: _Name) -> list[Address]:
        """Look ``name`` up, keeping its answer (before its callers wake to it)."""
        host, port, family = name
        try:
            lookup = socket.getaddrinfo if self._lookup_fn is None else self._lookup_fn
            answer = lookup(host, port, family, socket.SOCK_STREAM)
            with self._lock:
                self._answers[name] = (time.monotonic(), answer)
            return answer
        finally:
            with self._lock:
                self._asking.pop(name, None)


def _literal(host: str) -> bool:
    """Whether ``host`` is an IP address (IPv6 with a zone too), not a name."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def connect_host(address: Address) -> str:
    """The literal host to connect to ``address`` (an IPv6 one with its zone, when scoped)."""
    sockaddr = address[4]
    if len(sockaddr) >= 4 and sockaddr[3]:
        return f"{sockaddr[0]}%{sockaddr[3]}"
    return str(sockaddr[0])


RESOLVER = Resolver()  # the process's: its threads start on its first lookup
os.register_at_fork(after_in_child=RESOLVER.after_fork)
