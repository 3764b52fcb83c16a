"""A round trip on a connection taken from a pool, sent again once on a fresh connection
when the pooled one turns out to be dead.

A connection idle in a pool can be closed without the client being told: the store
restarted behind a load balancer or a virtual IP, a balancer's or a NAT's idle timeout
past, a connection closed just as it was taken. (redis-py's pool drops a connection whose
close it was told of before handing it out; not these.) The request on it then fails at
once, before any byte of a reply. Production clients (redis-py's retry of a pooled
connection's ``ConnectionError``, hiredis-cluster) send it again once on a fresh
connection, and so does ``PooledExchange``: only when the connection had served a round
trip before, no byte of a reply came on it, the failure is a lost connection (a reset, a
close; never a timeout: a slow store is not a gone one) and the round trip's deadline
(``deadline.bounded``) has time left. The fresh connection's failure ends the round trip,
so a store that is down still costs one failed round trip within its deadline, and a
store restarted costs none.

A connection whose server was demoted to a replica (a failover behind a virtual IP or a DNS
name: the address moved on to the new primary, the connection did not) answers every write
READONLY for as long as it lives. A reply that says so has the request sent again once on a
fresh connection, under the same conditions but the bytes received; a connection that still
reaches a replica is dropped, never reused.

Callers send only requests that may be applied twice: one lost with its connection may
have reached the store.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Protocol, TypeVar

from kvtier.remote.deadline import expired

log = logging.getLogger("kvtier")
T = TypeVar("T")
R = TypeVar("R", covariant=True)


class Request(Protocol[R]):
    """What one round trip asks on one connection: ``send`` writes all of it, ``read``
    reads every reply and says what they come to; either raises a transport fault, after
    which the connection is out of step. What its replies said of where its keys live is
    set by ``read`` (``resp.Refusals``: ``stale``, ``targets``, ``replica``); with
    ``asking`` set before ``send``, every command goes after an ``ASKING``; ``done``, the
    replies read before a failure partway."""

    stale: bool
    replica: bool
    asking: bool
    targets: dict[int, tuple[bool, str, int]]
    done: list[Any]

    def send(self, connection: Any) -> None: ...

    def read(self, connection: Any) -> R: ...


def lost_connection(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection is gone (reset, closed, a broken pipe): not a
    timeout, not a refusal of the credentials."""
    from redis.exceptions import AuthenticationError
    from redis.exceptions import ConnectionError as ClientConnectionError

    return (isinstance(exc, ConnectionError | ClientConnectionError)
            and not isinstance(exc, AuthenticationError))


class PooledExchange(Generic[T]):
    """``request`` on ``connection``, just taken from a pool: ``send()``, then ``read()``
    (a cluster writes to every node before it reads any). A failure of either on a
    connection that had served a round trip, as the module says, or replies saying it
    reaches a replica, have the connection made anew and the request sent on it again (and
    read), once; any other failure is raised.
    A round trip that ends well counts as served on its socket (a ``DeadlineSocket``)."""

    def __init__(self, connection: Any, request: Request[T]) -> None:
        self.connection, self.request = connection, request
        self._sock = connection._sock
        self._received = getattr(self._sock, "received", 0)
        self._again = getattr(self._sock, "served", 0) > 0  # pooled, not made for this one

    def send(self) -> None:
        try:
            self.request.send(self.connection)
        except Exception as exc:
            if not self._dead_on_arrival(exc):
                raise
            self._send_fresh(f"a pooled connection to the remote store was closed ({exc})")

    def read(self) -> T:
        try:
            result = self.request.read(self.connection)
        except Exception as exc:
            if not self._dead_on_arrival(exc):
                raise
            self._send_fresh(f"a pooled connection to the remote store was closed ({exc})")
            result = self.request.read(self.connection)
        if self.request.replica:
            result = self._off_replica(result)
        sock = self.connection._sock  # None: dropped (a reply too long, a replica's)
        if sock is not None and hasattr(sock, "served"):
            sock.served += 1
        return result

    def _dead_on_arrival(self, exc: BaseException) -> bool:
        """Whether the pooled connection was gone before the request reached the store."""
        return (self._again and lost_connection(exc) and not expired()
                and getattr(self._sock, "received", 0) == self._received)

    def _off_replica(self, result: T) -> T:
        """What the request comes to once a reply said the connection reaches a replica:
        sent again on a fresh connection when this one served before (the address may lead
        to the new primary now); a connection still reaching a replica is dropped."""
        if self._again and not expired():
            self._send_fresh("a pooled connection to the remote store reaches a replica now "
                             "(READONLY: a failover)")
            result = self.request.read(self.connection)
        if self.request.replica:
            self.connection.disconnect()
        return result

    def _send_fresh(self, why: str) -> None:
        self._again = False
        log.debug("kvtier: %s: sent again on a fresh connection", why)
        self.connection.disconnect()
        self.connection.connect()
        self.request.send(self.connection)


def exchange(pool: Any, request: Request[T]) -> T:
    """``request`` in one round trip on a connection of ``pool`` (``PooledExchange``); a
    failure drops the connection (it may be out of step with its replies) and is raised."""
    connection = pool.get_connection()
    try:
        pooled = PooledExchange(connection, request)
        pooled.send()
        return pooled.read()
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
