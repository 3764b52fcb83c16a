"""A Redis cluster's slot moving under the tier, against three real redis-servers: while a
slot migrates (``MIGRATING`` on its owner, ``IMPORTING`` on its next one) a key already
moved, or never there, is answered ``ASK``: the tier asks the node named, after ``ASKING``,
in the same round trip and within its deadline, so the chunk is read, written, looked up
and logged as if nothing moved; once the slot moved, a node that still gets its keys
answers ``MOVED``: asked again at the node named too, and the slot map asked for anew
(never while the slot only migrates)."""

import os
import signal
import time

import numpy as np
import pytest
from redis.crc import key_slot

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import PASSWORD_ENV, USER_ENV, RedisTier
from tests.helpers.redis_server import RedisCluster, needs_redis
from tests.helpers.redis_setup import LOG, NS, chunk, key, name, running

pytestmark = needs_redis
RAW = 16 * 1024


class Slot:
    """The slot of the store's key ``held``, its owner and another node, moved by hand as
    ``redis-cli --cluster reshard`` moves it."""

    def __init__(self, cluster: RedisCluster, held: bytes) -> None:
        self.number = key_slot(held)
        self.clients = {node.port: node.client() for node in cluster.nodes}
        self.ids = {port: c.execute_command("CLUSTER", "MYID").decode()
                    for port, c in self.clients.items()}
        self.owner = self.node_of(self.number)
        self.target = next(port for port in self.clients if port != self.owner)

    def node_of(self, number: int) -> int:
        """The port of the node serving slot ``number``, as the first node sees it."""
        return next(s[2][1] for s in next(iter(self.clients.values())).execute_command(
            "CLUSTER", "SLOTS") if s[0] <= number <= s[1])

    def begin(self) -> None:
        self.clients[self.target].execute_command("CLUSTER", "SETSLOT", self.number, "IMPORTING",
                                                  self.ids[self.owner])
        self.clients[self.owner].execute_command("CLUSTER", "SETSLOT", self.number, "MIGRATING",
                                                 self.ids[self.target])

    def move(self, *keys: bytes) -> None:
        self.clients[self.owner].execute_command("MIGRATE", "127.0.0.1", self.target, "", 0, 5000,
                                                 "KEYS", *keys)

    def end(self) -> None:
        """The slot is the target's: every node says so."""
        for port in (self.target, self.owner, *[p for p in self.clients
                                                if p not in (self.owner, self.target)]):
            self.clients[port].execute_command("CLUSTER", "SETSLOT", self.number, "NODE",
                                               self.ids[self.target])
        deadline = time.monotonic() + 30
        while any(self.owner_as_seen_by(c) != self.target for c in self.clients.values()):
            assert time.monotonic() < deadline, "the nodes never agreed on the slot's owner"
            time.sleep(0.05)

    def owner_as_seen_by(self, client) -> int:
        return next(s[2][1] for s in client.execute_command("CLUSTER", "SLOTS")
                    if s[0] <= self.number <= s[1])

    def refreshes(self) -> int:
        """Slot maps asked for, by any client, on every node."""
        return sum(int(c.info("commandstats").get("cmdstat_cluster|slots", {}).get("calls", 0))
                   for c in self.clients.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(RedisCluster(tmp_path_factory.mktemp("cluster"))) as started:
        yield started


def test_a_migrating_slot_is_read_written_and_looked_up_through_asking(cluster):
    """(each key ASK redirected was a miss for as long as the slot migrated, a write of a new
    key into it refused, and the slot map asked for anew at every round trip)"""
    tier = RedisTier(cluster.url, NS, RAW, timeout_s=5.0, retry_s=60.0, parts=(RAW // 2, RAW // 2))
    try:
        assert tier.put_many([(key(0), chunk(0, RAW))])[0].ok
        slot = Slot(cluster, name(key(0)))
        fresh = next(key(i) for i in range(1, 1 << 20) if key_slot(name(key(i))) == slot.number)
        assert tier.append_records([(key(0), b"record")])
        log = Slot(cluster, LOG)
        for moving in {slot.number: slot, log.number: log}.values():
            moving.begin()
        slot.move(name(key(0)))  # moved already: the owner answers ASK
        log.move(LOG)
        refreshes = slot.refreshes()
        for _ in range(3):
            into = np.zeros(RAW, np.uint8)
            got = tier.get_many([key(0)], [into])[0]
            assert got.ok and np.array_equal(into, chunk(0, RAW)), got
            assert tier.get_parts([key(0)], [into], [(1,)])[0].ok
            assert (tier.read_records(b"0", 1) or (b"", []))[1] == [(bytes(key(0)), b"record")]
            assert tier.put_many([(fresh, chunk(1, RAW))])[0].ok  # never there: ASK, written there
            assert tier.exists_answered([key(0), fresh]) == [True, True]
            assert tier.append_records([(key(0), b"record")])
        assert slot.refreshes() == refreshes  # the map is right: the slot only migrates
        for moving in {slot.number: slot, log.number: log}.values():
            moving.end()
        settle([slot, log])
        into = np.zeros(RAW, np.uint8)  # MOVED now, at the first round trip after
        assert tier.get_many([fresh], [into])[0].ok and np.array_equal(into, chunk(1, RAW))
        assert tier.failures == 0 and not tier.down
    finally:
        tier.close()


def test_a_key_whose_slot_moved_is_asked_for_at_its_new_node_at_once(cluster):
    """(the first round trip after a slot moved answered its keys as misses, or their writes
    as refused, until the slot map was asked for anew at the next round trip). A tier per
    kind of round trip, each holding the slot map of before; every slot moved once, and
    only then the round trips (a slot moving while the nodes still gossip about the last
    move can have them disagree for a while)."""
    tiers = [RedisTier(cluster.url, NS, RAW, timeout_s=5.0, retry_s=60.0, parts=(RAW // 2, RAW // 2))
             for _ in range(4)]
    try:
        keys = [key(7 + i) for i in range(4)]
        for tier in tiers:  # each has its slot map and a connection to each node
            assert all(r.ok for r in tier.put_many([(k, chunk(i, RAW)) for i, k in enumerate(keys)]))
        slots = [Slot(cluster, name(k)) for k in keys]
        for slot, k in zip(slots, keys, strict=True):
            slot.begin()
            slot.move(name(k))
            slot.end()
        settle(slots)
        calls = {
            "get": lambda tier, k: tier.get_many([k], [np.zeros(RAW, np.uint8)])[0].ok,
            "parts": lambda tier, k: tier.get_parts([k], [np.zeros(RAW, np.uint8)], [(1,)])[0].ok,
            "put": lambda tier, k: tier.put_many([(k, chunk(0, RAW))])[0].ok,
            "exists": lambda tier, k: tier.exists_answered([k]) == [True],
        }
        for tier, k, (what, call) in zip(tiers, keys, calls.items(), strict=True):
            assert call(tier, k), what  # the tier's map still names the old owner
            assert tier.exists_answered(keys) == [True] * 4  # the map asked for anew
            assert tier.failures == 0 and not tier.down
    finally:
        for tier in tiers:
            tier.close()


def settle(slots: list[Slot]) -> None:
    """Until every node has said for a while that each slot is its target's."""
    deadline, agreed = time.monotonic() + 30, 0
    while agreed < 10:
        assert time.monotonic() < deadline, "the nodes never agreed on the slots' owners"
        same = all(s.owner_as_seen_by(c) == s.target for s in slots for c in s.clients.values())
        agreed = agreed + 1 if same else 0
        time.sleep(0.05)


def test_a_refused_asking_or_a_node_that_fails_when_asked_again_costs_that_key_only(cluster):
    """An ACL user without ``+asking``: the node named answers ``MOVED`` back, a miss, and
    the connection stays in step; the node a key is sent to hung: that key is a miss once the
    round trip's deadline passed (that node out of service alone), the other keys are
    answered and the tier stays in service."""
    slot, tiers = None, []
    try:
        for client in (n.client() for n in cluster.nodes):
            client.execute_command("ACL", "SETUSER", "kvtier", "on", ">secret", "~kvtier:*", "+@all",
                                   "-asking")
        keys = [key(100 + i) for i in range(12)]
        for environ in ({USER_ENV: "kvtier", PASSWORD_ENV: "secret"}, {}):
            for _ in range(10):  # each with a connection to every node; on a loaded machine
                tiers.append(RedisTier(cluster.url, NS, RAW, timeout_s=1.0, retry_s=60.0,
                                       environ=environ))  # a connect may miss its share of
                put = tiers[-1].put_many([(k, chunk(i, RAW)) for i, k in enumerate(keys)])
                if all(r.ok for r in put):  # the deadline (its node then out): made anew
                    break
                tiers.pop().close()
            assert all(r.ok for r in put), put
        slot = Slot(cluster, name(keys[0]))
        others = [k for k in keys[1:] if slot.node_of(key_slot(name(k))) != slot.target]
        slot.begin()
        slot.move(name(keys[0]))
        for tier, hung in zip(tiers, (False, True), strict=True):
            if hung:
                target = next(n for n in cluster.nodes if n.port == slot.target)
                os.kill(target.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            into = [np.zeros(RAW, np.uint8) for _ in range(len(others) + 1)]
            got = tier.get_many([keys[0], *others], into)
            assert time.monotonic() - started < 3.0
            if hung:  # the node named failed when asked again: its failure, a miss
                assert got[0].status is IOStatus.TIMED_OUT, got[0]
            else:  # sent back: the redirect's error, a miss
                assert got[0].status is IOStatus.IO_ERROR and got[0].detail.startswith(
                    ("get: ASK ", "get: MOVED "))
            assert all(r.ok for r in got[1:]), got
            assert tier.exists_answered(others) == [True] * len(others)
            assert tier.failures == 0 and not tier.down
    finally:
        for node in cluster.nodes:
            os.kill(node.process.pid, signal.SIGCONT)
        for tier in tiers:
            tier.close()
        if slot is not None:
            slot.end()
