"""A connect inside a round trip's deadline waits at most the time left, for the TCP connect
and for a TLS connection's handshake after it: redis-py gives the handshake the connect
timeout again, so a connect could take twice the time left."""

import socket
import time

import pytest

redis_connection = pytest.importorskip("redis.connection")

from kvtier.remote.deadline import DeadlineSocket, bounded, deadline_class  # noqa: E402

TCP_S = 0.3  # the TCP connect's own time, before the handshake


@pytest.fixture
def handshakes(monkeypatch):
    """The connect timeout each TLS handshake was given; the TCP connect takes ``TCP_S``.
    ``given.sockets``: the timeout of the socket each handshake ran on."""
    given = Given()
    pairs: list[socket.socket] = []

    def tcp(self):
        time.sleep(TCP_S)
        ours, theirs = socket.socketpair()
        pairs.extend((ours, theirs))
        return ours

    def wrap(self, sock):
        given.append(self.socket_connect_timeout)
        given.sockets.append(sock.gettimeout())
        return sock

    monkeypatch.setattr(redis_connection.Connection, "_connect", tcp)
    monkeypatch.setattr(redis_connection.SSLConnection, "_wrap_socket_with_ssl", wrap)
    yield given
    for sock in pairs:
        sock.close()


class Given(list):
    sockets: list[float | None]

    def __init__(self) -> None:
        super().__init__()
        self.sockets = []


def tls_connection(timeout: float | None, receives: float | None = None):
    return deadline_class(redis_connection.SSLConnection)(socket_connect_timeout=timeout,
                                                          socket_timeout=receives)


def test_a_tls_handshake_gets_only_the_time_left_after_the_tcp_connect(handshakes):
    conn = tls_connection(timeout=5.0)
    with bounded(1.0):
        sock = conn._connect()
    assert isinstance(sock, DeadlineSocket)
    assert handshakes[0] is not None and handshakes[0] <= 1.0 - TCP_S
    assert conn.socket_connect_timeout == 5.0  # what the connection asked for, restored


def test_the_handshakes_socket_waits_only_the_time_left_then_the_receives_timeout(handshakes):
    """redis-py before 8.2 leaves the socket at ``socket_timeout`` for the handshake: the
    socket itself is given the time left, and the receives' timeout once it is over."""
    conn = tls_connection(timeout=5.0, receives=7.0)
    with bounded(1.0):
        sock = conn._connect()
    assert handshakes.sockets[0] is not None and handshakes.sockets[0] <= 1.0 - TCP_S
    assert sock.gettimeout() == 7.0


def test_without_a_deadline_the_handshake_gets_the_connect_timeout(handshakes):
    conn = tls_connection(timeout=5.0)
    conn._connect()
    assert handshakes == [5.0]


def test_a_connect_past_its_deadline_fails_before_the_handshake(handshakes):
    conn = tls_connection(timeout=5.0)
    with bounded(TCP_S / 2), pytest.raises(TimeoutError, match="past its deadline"):
        conn._connect()
    assert handshakes == [] and conn.socket_connect_timeout == 5.0
