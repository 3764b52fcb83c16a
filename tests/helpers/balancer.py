"""A TCP load balancer for the tests, on 127.0.0.1 in front of a real server, that forgets
flows the way many do (a cloud network load balancer past its idle timeout, NAT or
conntrack state gone, a server replaced behind a virtual IP): when the server side of a
flow closes (the server restarted, ``CLIENT KILL``), or ``forget()`` drops every flow,
the client is told nothing; its next send is answered with a reset. A client that checks
its idle connections before using them (redis-py's pool does) cannot see such a flow is
dead until its request fails. Setting ``target_port`` moves it: flows opened later go to
that port (a virtual IP moved to another server), those open stay where they were.

Every loop is bounded (``stop()``, a closed socket, a short poll)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time

from tests.helpers.loopback import Loopback


class _Flow:
    def __init__(self, client: socket.socket, server: socket.socket | None) -> None:
        self.client, self.server = client, server
        self.dead = server is None  # the server side is gone: the next send is reset


class Balancer(Loopback):
    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self._flows: list[_Flow] = []
        self.connections = 0  # flows clients opened
        self.resets = 0  # sends answered with a reset
        self.start()

    def _accepted(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:  # no server: the client's first send is reset
            server = None
        flow = _Flow(client, server)
        with self._lock:
            self._flows.append(flow)
            self.connections += 1
        self._spawn(self._requests, flow)
        if server is not None:
            self._spawn(self._answers, flow)

    def _requests(self, flow: _Flow) -> None:
        """Client to server; a send on a dead flow is reset."""
        flow.client.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = flow.client.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if flow.dead or not self._forward(flow, data):
                self._reset(flow)
                return
        self._close(flow)

    def _forward(self, flow: _Flow, data: bytes) -> bool:
        try:
            assert flow.server is not None
            flow.server.sendall(data)
            return True
        except OSError:
            return False

    def _answers(self, flow: _Flow) -> None:
        """Server to client; the server's close is kept from the client."""
        assert flow.server is not None
        flow.server.settimeout(0.1)
        while not self._stop.is_set() and not flow.dead:
            try:
                data = flow.server.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            with contextlib.suppress(OSError):
                flow.client.sendall(data)
        flow.dead = True

    def _reset(self, flow: _Flow) -> None:
        with self._lock:
            self.resets += 1
        with contextlib.suppress(OSError):
            flow.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._close(flow)

    def _close(self, flow: _Flow) -> None:
        flow.dead = True
        for s in (flow.client, flow.server):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()

    def forget(self) -> None:
        """Drop every flow open now, telling no client."""
        with self._lock:
            flows = list(self._flows)
        for flow in flows:
            flow.dead = True
            if flow.server is not None:
                with contextlib.suppress(OSError):
                    flow.server.shutdown(socket.SHUT_RDWR)

    def wait_dead(self, timeout: float = 10.0) -> None:
        """Wait until every flow open now has lost its server side (a restart, a kill)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                alive = [f for f in self._flows if not f.dead]
            if not alive:
                return
            assert time.monotonic() < deadline, f"{len(alive)} flows still reach the server"
            time.sleep(0.02)

    def stop(self) -> None:
        super().stop()
        with self._lock:
            flows = list(self._flows)
        for flow in flows:
            self._close(flow)
