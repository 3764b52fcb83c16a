"""A hybrid model's chunks through the remote store: a load whose sliding-window group has left
a chunk reads from the store only the parts of the groups that still keep blocks of it
(Redis GETRANGE), each checked, and the staging slot holding part of a chunk is never kept
as a host hit."""

import pytest

from kvtier.connector.common.messages import NULL_BLOCK, StepPlan
from kvtier.remote.values import ValueFormat
from kvtier.tiers.base import TierName
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import CHUNK, request
from tests.helpers.window import WORKER_GEO, same

pytestmark = needs_redis
GEO = WORKER_GEO  # two groups of two layers: full attention, then a 32-token window


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def engine(server) -> Engine:
    return Engine(server, GEO, remote_timeout="2s")


def test_a_chunk_the_window_left_is_read_from_the_store_in_part(server):
    a, b = engine(server), engine(server)
    try:
        req = request("r", 2 * CHUNK + 1, seed=5)
        meta = StepPlan()
        a.scheduler.plan_stores(req, ([1, 2, 3, 4], [5, 6, 7, 8]), req.num_tokens, meta)
        for _ in range(3):  # the stores, their remote writes, their outcomes
            a.step(meta)
            meta = None
        assert a.scheduler.counters["remote_written_chunks"] == 2
        form = ValueFormat(a.ns.digest(), GEO.chunk_bytes, GEO.part_bytes)
        raw = server.client()
        keys = a.scheduler.chunk_keys(req, 2)
        names = [f"kvtier:{a.ns.digest().hex()}:{bytes(k).hex()}".encode() for k in keys]
        value = bytearray(raw.get(names[0]))
        value[form.header_bytes + GEO.part_bytes[0] + 11] ^= 0x40  # the part this load skips
        raw.set(names[0], bytes(value))

        assert b.match(req) == (2 * CHUNK, True)
        sliding = [NULL_BLOCK, NULL_BLOCK, 13, 14]  # chunk 0 is out of the window
        b.scheduler.plan_load(req, ([9, 10, 11, 12], sliding), 0, 2 * CHUNK)
        before = int(raw.info("stats")["total_net_output_bytes"])
        b.step()
        moved = int(raw.info("stats")["total_net_output_bytes"]) - before
        assert b.worker.take_invalid_blocks() == set() and b.worker.take_failed_loads() == set()
        assert moved < 2 * GEO.chunk_bytes - GEO.part_bytes[1] + 8192  # not the skipped part
        for layer in (0, 1):  # the full group: both chunks
            assert same(b.kv[layer][9:13], a.kv[layer][1:5])
        for layer in (2, 3):  # the sliding group: chunk 1 only
            assert same(b.kv[layer][13:15], a.kv[layer][7:9])
        b.step()
        assert b.scheduler.counters["load_chunks_in_part"] == 1
        assert b.scheduler.counters["load_failed_chunks"] == 0
        host = b.scheduler.stack.indexes[TierName.HOST]
        assert not host.has_entry(keys[0])  # part of a chunk: never a host hit
        assert b.scheduler.stack.locate(keys[1]).tier is TierName.HOST

        # read whole, the damaged part is seen: recomputed, never loaded
        c = engine(server)
        try:
            assert c.match(req) == (2 * CHUNK, True)
            c.scheduler.plan_load(req, ([9, 10, 11, 12], [5, 6, 7, 8]), 0, 2 * CHUNK)
            c.step()  # a hybrid model's failed load: vLLM recomputes the request
            assert c.worker.take_failed_loads() == {"r"}
            assert c.worker.stats().data["remote_failures"] == 1
        finally:
            c.close()
    finally:
        a.close()
        b.close()
