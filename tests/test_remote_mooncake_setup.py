"""Setting up a Mooncake Store client, without Mooncake: one set-up at a time, and the
callers that waited on one that failed find the tier out of service instead of each trying
again (a hung master would otherwise cost the k-th caller k set-ups)."""

import socket
import threading
import time
from typing import ClassVar

import numpy as np

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote import mooncake_tier

NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)


class FailingStore:
    """A client whose set-up takes a while, then fails (a master that hangs, then errs)."""

    setups = 0

    def setup(self, *args) -> int:
        FailingStore.setups += 1
        time.sleep(0.5)
        return -1

    def close(self) -> None:
        pass


class FakeModule:
    MooncakeDistributedStore = FailingStore


def test_callers_that_waited_on_a_failed_setup_do_not_set_it_up_again(monkeypatch):
    monkeypatch.setattr(mooncake_tier, "client_module", lambda: FakeModule)
    with socket.socket() as master:  # takes connections: the port probe passes
        master.bind(("127.0.0.1", 0))
        master.listen(16)
        url = f"mooncake://127.0.0.1:{master.getsockname()[1]}?host=127.0.0.1"
        tier = mooncake_tier.MooncakeTier(url, NS, 4096, timeout_s=1.0, retry_s=60, environ={})
        answers: list[IOStatus] = []

        def call(i: int) -> None:
            (result,) = tier.put_many([(ChunkKey(bytes([i]) * 16), np.zeros(4096, np.uint8))])
            answers.append(result.status)

        callers = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=30)
    assert len(answers) == 6 and not any(a is IOStatus.OK for a in answers)
    assert FailingStore.setups == 1 and tier.failures == 1
    tier.close()


class SlowStore:
    """A client whose lookups of key 0 and key 1 wait for the test (a healthy store, busy)."""

    gates: ClassVar[dict[int, threading.Event]] = {0: threading.Event(), 1: threading.Event()}
    names: ClassVar[list[str]] = []

    def setup(self, *args) -> int:
        return 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        for i, gate in SlowStore.gates.items():
            if names == [SlowStore.names[i]]:
                assert gate.wait(20), "the test never let the lookup end"
        return [1] * len(names)

    def close(self) -> None:
        pass


def test_a_call_queued_behind_calls_in_time_misses_alone_and_the_tier_stays_in_service(monkeypatch):
    """Every call thread busy with lookups the store answers within the deadline: the lookup
    still queued at its deadline fails alone (no answer: not "none held"), the tier is not
    taken out of service, and the next lookup is answered."""
    from kvtier.remote.watched_calls import WatchedCalls

    monkeypatch.setattr(mooncake_tier, "client_module", lambda: type("M", (), {
        "MooncakeDistributedStore": SlowStore}))
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(16)
        url = f"mooncake://127.0.0.1:{master.getsockname()[1]}?host=127.0.0.1"
        tier = mooncake_tier.MooncakeTier(url, NS, 4096, timeout_s=2.0, retry_s=60, environ={})
        SlowStore.names = [tier._names([key])[0] for key in keys]
        tier._calls.close()
        tier._calls = WatchedCalls(2.0, tier._failed, threads=1)  # one call at a time
        answers: dict[int, object] = {}
        lookups = [threading.Thread(target=lambda i=i: answers.update(
            {i: tier.exists_answered([keys[i]])})) for i in range(3)]
        for lookup in lookups:
            lookup.start()
            time.sleep(0.1)  # in this order: 0 runs, 1 and 2 queued
        time.sleep(0.9)
        SlowStore.gates[0].set()  # 1 s in: the first ends in time, the second runs from now
        lookups[2].join(10)  # the third's deadline: the second 1 s into its 2 s
        SlowStore.gates[1].set()
        for lookup in lookups:
            lookup.join(10)
        # the second's answer is None too: a call failed while it ran (no loss reported)
        assert answers == {0: [True], 1: None, 2: None}
        assert not tier.down and tier.failures == 1
        assert tier.exists([keys[2]]) == [True]
        tier.close()


class UnansweredStore:
    """A client whose master takes connections but answers no call (until ``answers``)."""

    answers = False

    def setup(self, *args) -> int:
        return 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        from kvtier.remote.mooncake_client import RPC_FAIL

        return [1 if UnansweredStore.answers else RPC_FAIL] * len(names)

    def close(self) -> None:
        pass


def test_the_tier_is_back_in_service_once_a_call_works_not_once_the_port_takes_a_connection(
        monkeypatch, caplog):
    """A paused or broken master whose port still takes connections (its kernel does): the
    probe before a trial passes, the call fails. The tier is not said back in service then,
    only once a call works."""
    import logging

    monkeypatch.setattr(mooncake_tier, "client_module", lambda: type("M", (), {
        "MooncakeDistributedStore": UnansweredStore}))
    caplog.set_level(logging.INFO, logger="kvtier")
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(16)
        url = f"mooncake://127.0.0.1:{master.getsockname()[1]}?host=127.0.0.1"
        tier = mooncake_tier.MooncakeTier(url, NS, 4096, timeout_s=1.0, retry_s=0.1, environ={})
        for _ in range(3):  # trials after remote_retry: the port takes them, the call fails
            assert tier.exists_answered([ChunkKey(b"k" * 16)]) is None and tier.down
            time.sleep(0.15)
        assert "back in service" not in caplog.text
        UnansweredStore.answers = True
        assert tier.exists_answered([ChunkKey(b"k" * 16)]) == [True] and not tier.down
        assert caplog.text.count("back in service") == 1
        tier.close()


def test_a_threads_scratch_it_outgrew_is_unregistered_and_let_go():
    """A thread's scratch grows by doubling; the one it outgrew stayed registered and held
    for the tier's life (a thread that once staged a 256 MiB read kept every smaller one)."""
    from kvtier.remote.mooncake_memory import RegisteredMemory

    class Client:
        def __init__(self):
            self.registered: dict[int, int] = {}

        def register_buffer(self, at: int, nbytes: int) -> int:
            self.registered[at] = nbytes
            return 0

        def unregister_buffer(self, at: int) -> int:
            return 0 if self.registered.pop(at, None) is not None else -1

    client, memory = Client(), RegisteredMemory("mooncake://m", 128, 4096)
    small = memory.area(client, 100)
    assert memory.area(client, 100) is small  # kept while it fits
    big = memory.area(client, 64 * 1024)
    assert big.nbytes >= 64 * 1024 and list(client.registered) == [big.ctypes.data]
    assert len(memory._scratch) == 1 and memory._scratch[0] is big


class AnyStore:
    """A client that sets up, and holds nothing."""

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, *args) -> int:
        return 0

    def batch_is_exist(self, names) -> list[int]:
        return [0] * len(names)

    def close(self) -> None:
        pass


class AnyModule:
    MooncakeDistributedStore = AnyStore


def test_a_masters_name_the_resolver_does_not_answer_for_holds_a_caller_no_longer_than_the_timeout(
        monkeypatch):
    """The master's port probe and the client's own address look the master's name up
    within ``remote_timeout`` (``RESOLVER``), as the Redis tier does: a resolver that does
    not answer held each caller for its own timeouts and retries (a review: 4 s against a
    timeout of 0.5 s)."""
    from kvtier.remote import resolve

    release, real = threading.Event(), socket.getaddrinfo

    def hung_lookup(host, *args, **kwargs):  # the master's name: a resolver that never answers
        if host != "master.example":
            return real(host, *args, **kwargs)
        release.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    monkeypatch.setattr(socket, "getaddrinfo", hung_lookup)
    monkeypatch.setattr("kvtier.remote.mooncake_client.RESOLVER", resolve.Resolver())
    monkeypatch.setattr(mooncake_tier, "client_module", lambda: AnyModule)
    tier = mooncake_tier.MooncakeTier("mooncake://master.example:50051", NS, 4096,
                                      timeout_s=0.5, retry_s=60, environ={})
    try:
        began = time.monotonic()
        assert tier.exists_answered([ChunkKey(b"k" * 16)]) is None  # failed: out of service
        assert time.monotonic() - began < 2.0 and tier.down
    finally:
        release.set()
        tier.close()


def test_the_master_is_reached_on_any_of_its_addresses_and_named_by_ipv4_first(monkeypatch):
    """A name with an IPv6 and an IPv4 address (``localhost`` on many hosts), the master
    listening on IPv4 only: the port probe tries each address (it tried the first only, and
    the tier never came up: a review), and the client's own address is IPv4's."""
    from kvtier.remote import mooncake_client, resolve

    def both(host, port, family, kind):  # (nothing listens on 127.0.0.2, nor on ::1)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
    monkeypatch.setattr(mooncake_client, "RESOLVER", resolve.Resolver(lookup=both))
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(4)
        where = f"master.example:{master.getsockname()[1]}"
        mooncake_client.reachable(where, 2.0)
        assert mooncake_client.local_address(where, 2.0).startswith("127.0.0.")
