"""Host names resolved within a deadline (``kvtier/remote/resolve.py``): a resolver that does
not answer costs a round trip its deadline, not its own timeouts; concurrent lookups of one
name share one; an answer is kept a while, and used past that while the resolver fails."""

import socket
import threading
import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote import resolve
from kvtier.remote.resolve import Resolver
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import NS, RAW, chunk, key

LOCAL = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 6379))]


class Lookups:
    """A resolver's lookups: each answers ``LOCAL``, fails, or hangs until released."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.hang = threading.Event()  # set: lookups hang until ``release``
        self.release = threading.Event()
        self.fail = False

    def __call__(self, host, port, family, kind):
        self.asked.append(host)
        if self.hang.is_set():
            assert self.release.wait(20), "the test never released the lookup"
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return LOCAL


def test_a_resolver_that_does_not_answer_costs_the_caller_its_timeout_only():
    lookups = Lookups()
    lookups.hang.set()
    resolver = Resolver(lookup=lookups)
    errors: list[BaseException] = []

    def ask():
        try:
            resolver.addresses("store.example", 6379, 0, 0.3)
        except TimeoutError as exc:
            errors.append(exc)
    callers = [threading.Thread(target=ask) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert len(errors) == 4 and "resolving store.example took longer than 0.3 s" in str(errors[0])
    assert lookups.asked == ["store.example"]  # one lookup for all four
    lookups.hang.clear()
    lookups.release.set()  # it ends: its answer is kept
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and resolver.addresses("store.example", 6379, 0, 5.0) != LOCAL:
        time.sleep(0.01)
    assert resolver.addresses("store.example", 6379, 0, 0.0) == LOCAL


def test_an_answer_is_kept_and_past_that_used_at_once_while_the_name_is_asked_again(monkeypatch):
    lookups = Lookups()
    resolver = Resolver(lookup=lookups)
    assert resolver.addresses("store.example", 6379, 0, 5.0) == LOCAL
    assert resolver.addresses("store.example", 6379, 0, 5.0) == LOCAL
    assert lookups.asked == ["store.example"]  # kept
    monkeypatch.setattr(resolve, "TTL_S", 0.0)
    lookups.fail = True
    assert resolver.addresses("store.example", 6379, 0, 5.0) == LOCAL  # the last answer
    wait_for(lambda: len(lookups.asked) == 2 and not resolver._asking)  # asked again: failed
    lookups.hang.set()
    answers: list = []
    asking = threading.Thread(target=lambda: answers.append(
        resolver.addresses("store.example", 6379, 0, None)))  # no bound: a wait would hang
    asking.start()
    asking.join(5)
    assert answers == [LOCAL], "a kept answer waited on a resolver that does not answer"
    lookups.release.set()
    with pytest.raises(socket.gaierror):  # a name never answered: the resolver's error
        resolver.addresses("other.example", 6379, 0, 5.0)


def test_a_literal_address_is_its_own_answer_without_the_resolver():
    lookups = Lookups()
    lookups.hang.set()  # a lookup would hang
    resolver = Resolver(lookup=lookups)
    (answer,) = resolver.addresses("127.0.0.1", 6379, socket.AF_INET, 0.0)
    assert answer[4] == ("127.0.0.1", 6379) and lookups.asked == []
    assert resolve.connect_host((socket.AF_INET6, 1, 6, "", ("fe80::1", 6379, 0, 2))) == "fe80::1%2"
    assert resolve.connect_host(answer) == "127.0.0.1"


def test_a_lookup_no_thread_can_start_for_fails_as_the_resolver_would():
    from concurrent.futures import ThreadPoolExecutor

    resolver = Resolver(lookup=Lookups())
    resolver._pool = ThreadPoolExecutor(1)
    resolver._pool.shutdown()  # every submit refused
    with pytest.raises(OSError, match="no thread to look it up"):
        resolver.addresses("store.example", 6379, 0, 1.0)
    assert not resolver._asking
    resolver.after_fork()  # as in a child process: new threads on the next lookup
    assert resolver.addresses("store.example", 6379, 0, 5.0) == LOCAL


def wait_for(done, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


@needs_redis
def test_a_store_named_by_a_host_whose_resolver_hangs_fails_within_remote_timeout(tmp_path, monkeypatch):
    """The tier's round trip to a store named by a host name, its resolver hung: the round
    trip fails within ``remote_timeout`` (the tier goes out of service) instead of holding
    its caller for the resolver's own timeouts; with the resolver back, the store serves."""
    from kvtier.remote import deadline
    from kvtier.remote.redis_tier import RedisTier

    server = RedisServer(tmp_path / "redis").start()
    lookups, system = Lookups(), socket.getaddrinfo
    lookups.hang.set()

    def hung(host, port, *more):  # the system's resolver: the store's name hangs
        if host == "store.example":
            lookups(host, port, 0, 0)
            host = "127.0.0.1"
        return system(host, port, *more)
    monkeypatch.setattr(socket, "getaddrinfo", hung)
    monkeypatch.setattr(deadline, "RESOLVER", Resolver())  # a fresh one: nothing kept
    tier = RedisTier(f"redis://store.example:{server.port}", NS, RAW, timeout_s=0.5, retry_s=0.2)
    try:
        started = time.monotonic()
        (result,) = tier.put_many([(key(1), chunk(1))])
        assert result.status in (IOStatus.TIMED_OUT, IOStatus.IO_ERROR, IOStatus.PATH_DOWN)
        assert time.monotonic() - started < 3.0 and tier.down  # not the test's 20 s hang
        lookups.hang.clear()
        lookups.release.set()
        time.sleep(0.3)  # past remote_retry
        assert tier.put_many([(key(1), chunk(1))])[0].ok
        out = np.zeros(RAW, np.uint8)
        assert tier.get_many([key(1)], [out])[0].ok and np.array_equal(out, chunk(1))
        assert lookups.asked and set(lookups.asked) == {"store.example"}
    finally:
        tier.close()
        server.stop()
