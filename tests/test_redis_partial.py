"""A round trip that fails partway through its replies, against a real redis-server behind
a proxy that stops passing its answer on after a given byte: the chunks read before the
failure are kept (whole and checked), the rest are the failure, and the tier goes out of
service all the same; on one server and on a cluster's node."""

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import RedisTier
from kvtier.remote.values import ValueFormat
from tests.helpers.drip_proxy import DripProxy
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import NS, RAW, chunk, key, running, wait_cluster

pytestmark = needs_redis
KEYS = [key(i) for i in range(6)]


def reply_bytes() -> int:
    """The bytes of one GET's reply of a chunk: ``$<length>``, the value, CRLF."""
    length = ValueFormat(NS.digest(), RAW).header_bytes + RAW
    return len(b"$%d\r\n" % length) + length + 2


@contextmanager
def cluster_node(server: RedisServer, proxy: DripProxy) -> Iterator[RedisServer]:
    """``server`` run for the block as a one-node cluster holding every slot, that names
    the proxy's address as its own: a cluster client reaches it through ``proxy``."""
    server.extra += ("--cluster-announce-port", str(proxy.port),
                     "--cluster-announce-bus-port", str(server.port + 10000))
    with running(server):
        server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_cluster(server)
        yield server


@contextmanager
def stalling_tier(workdir, kind: str) -> Iterator[tuple[RedisTier, DripProxy]]:
    """A tier holding ``KEYS``, on one server or a one-node cluster behind a proxy that can
    stall its answers (``stall_after``), every connection made."""
    cluster = kind == "cluster"
    extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf") if cluster else ()
    server = RedisServer(workdir / "redis", *extra)
    proxy = DripProxy(server.port, piece=1 << 20, pause=0.0, lifetime=120)
    with proxy, cluster_node(server, proxy) if cluster else running(server):
        url = (f"redis+cluster://127.0.0.1:{proxy.port}" if cluster else proxy.url)
        tier = RedisTier(url, NS, RAW, timeout_s=2.0, retry_s=60)
        try:
            assert all(r.ok for r in tier.put_many([(k, chunk(i)) for i, k in enumerate(KEYS)]))
            assert tier.exists(KEYS) == [True] * len(KEYS)
            yield tier, proxy
        finally:
            tier.close()


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_a_get_that_fails_partway_keeps_the_chunks_read_before_it(tmp_path, kind):
    with stalling_tier(tmp_path, kind) as (tier, proxy):
        proxy.stall_after = proxy.answered + 3 * reply_bytes() + 100  # into the 4th
        dsts = [np.zeros(RAW, np.uint8) for _ in KEYS]
        got = tier.get_many(KEYS, dsts)
        assert [r.ok for r in got] == [True] * 3 + [False] * 3, got
        assert all(np.array_equal(dsts[i], chunk(i)) for i in range(3))
        assert {r.status for r in got[3:]} == {IOStatus.TIMED_OUT}
        assert tier.down and tier.failures == 1  # out of service all the same


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_a_put_that_fails_partway_says_which_chunks_were_stored(tmp_path, kind):
    with stalling_tier(tmp_path, kind) as (tier, proxy):
        proxy.stall_after = proxy.answered + 3 * len(b"+OK\r\n") + 2  # into the 4th
        put = tier.put_many([(k, chunk(i)) for i, k in enumerate(KEYS)])
        assert [r.ok for r in put] == [True] * 3 + [False] * 3, put
        assert {r.status for r in put[3:]} == {IOStatus.TIMED_OUT}
        assert tier.down and tier.failures == 1
