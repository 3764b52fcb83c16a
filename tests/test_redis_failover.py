"""One Valkey/Redis server's failover behind a virtual IP (or a DNS name, a managed service's
primary endpoint), against real redis-servers: the primary demoted to a replica of another,
the address moved to the new primary. A pooled connection still reaches the old primary,
which answers every write READONLY: it is dropped and its request sent again once on a
fresh connection, which reaches the new primary; a fresh connection that answers READONLY
too fails those writes and is dropped, so the next round trip connects anew."""

import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.balancer import Balancer
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import LOG, NS, RAW, chunk, key, name, running

pytestmark = needs_redis


@pytest.fixture
def pair(tmp_path):
    with (running(RedisServer(tmp_path / "old")) as old, running(RedisServer(tmp_path / "new")) as new,
          Balancer(old.port) as vip):  # the address the tier is given
        yield old, new, vip


def demote(old: RedisServer, new: RedisServer) -> None:
    """``old`` becomes a replica of ``new`` (its clients' connections stay open)."""
    old.client().execute_command("REPLICAOF", "127.0.0.1", new.port)
    deadline = time.monotonic() + 30
    while old.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)


def fail_over(servers: list[RedisServer], vip: Balancer) -> None:
    """The primary (``servers[0]``) demoted to a replica of the other, which is promoted,
    and the virtual IP moved to it; ``servers`` swapped to say so."""
    servers[1].client().execute_command("REPLICAOF", "NO", "ONE")
    demote(servers[0], servers[1])
    vip.target_port = servers[1].port
    servers.reverse()


def test_writes_after_a_failover_behind_a_virtual_ip_reach_the_new_primary(pair):
    """(every write on a pooled connection to the old primary failed READONLY for as long
    as the connection lived, kept alive by keepalive: no chunk reached the store again)"""
    old, new, vip = pair
    servers = [old, new]
    tier = RedisTier(vip.url, NS, RAW, timeout_s=5.0, retry_s=60.0)
    try:
        for i, what in enumerate(["put", "append", "remove"]):
            assert tier.put_many([(key(100), chunk(100))])[0].ok  # a connection that served
            fail_over(servers, vip)
            primary = servers[0].client()
            if what == "put":
                assert tier.put_many([(key(i), chunk(i))])[0].ok
                assert primary.exists(name(key(i))) == 1
            elif what == "append":
                assert tier.append_records([(key(i), b"record")])
                assert primary.xlen(LOG) >= 1
            else:
                primary.set(name(key(i)), b"not a chunk")
                assert tier.remove([key(i)]) and primary.exists(name(key(i))) == 0
            assert tier.failures == 0 and not tier.down, what
        into = np.zeros(RAW, np.uint8)  # (what replication had not copied when a failover
        assert tier.put_many([(key(50), chunk(50))])[0].ok  # came is gone: a key of its own)
        assert tier.get_many([key(50)], [into])[0].ok and np.array_equal(into, chunk(50))
    finally:
        tier.close()


def test_a_fresh_connection_to_a_replica_fails_the_write_and_is_not_kept(pair):
    """The address still leads to the old primary (the virtual IP not moved yet): the write
    is refused, not taken as written, and the connection dropped; once the address moves,
    the next write reaches the new primary."""
    old, new, vip = pair
    tier = RedisTier(vip.url, NS, RAW, timeout_s=5.0, retry_s=60.0)
    try:
        assert tier.exists_answered([key(1)]) == [False]
        demote(old, new)
        opened = vip.connections
        refused = tier.put_many([(key(1), chunk(1))])[0]
        assert refused.status is IOStatus.IO_ERROR and "read only" in refused.detail
        assert vip.connections == opened + 1  # sent again once, on a fresh connection
        vip.target_port = new.port
        assert tier.put_many([(key(1), chunk(1))])[0].ok
        assert new.client().exists(name(key(1))) == 1
        assert tier.failures == 0 and not tier.down
    finally:
        tier.close()
