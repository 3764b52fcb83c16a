"""``KVStore`` with a Mooncake Store remote tier, inside a private network namespace
(tests/test_remote_mooncake.py runs this module there): two stores with separate host memory
("two nodes") share chunks through the store, byte for byte, with each host tier registered
with the transfer engine; under load, the master killed and restarted empty costs misses
only, and hits through the store resume."""

import time

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.faults import Load, check
from tests.helpers.kv import CHUNK, SMALL, make_kv, same_bytes
from tests.helpers.mooncake_server import MooncakeServer, inside_namespace

if not inside_namespace():
    pytest.skip("runs only inside a private network namespace: tests/test_remote_mooncake.py "
                "starts it there", allow_module_level=True)

CHUNK_BYTES = SMALL.token_bytes * CHUNK


@pytest.fixture
def server(tmp_path):
    srv = MooncakeServer(tmp_path / "mooncake").start()
    yield srv
    srv.stop()


def store(url: str) -> KVStore:
    return KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES,
                           "remote_url": url, "remote_timeout": "1s", "remote_retry": "300ms",
                           "io_threads": 2}, model="m")


def tokens(seed: int, chunks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, chunks * CHUNK).tolist()


def test_a_second_node_reads_what_the_first_stored_with_no_copy(server):
    toks = tokens(1, 6)
    with store(server.url) as a, store(server.url) as b:
        assert a.put(toks, make_kv(toks)) == len(toks)
        assert a.flush(20) and a.stats().remote_writes == 6
        assert b.lookup(toks).chunks_by_tier == {TierName.REMOTE: 6}
        out = torch.zeros_like(make_kv(toks))
        assert b.get(toks, out) == len(toks) and same_bytes(out, make_kv(toks))
        assert b.stats().remote_reads == 6
        assert a._state.remote.tier.staged == 0 and b._state.remote.tier.staged == 0
        assert b.metric_samples()  # the remote rows render
        samples = {s.name: s for s in b.metric_samples()}
        assert samples["remote_chunks_total"].values[(("backend", "mooncake"), ("direction", "read"))] == 6


def test_the_master_killed_and_restarted_under_load_costs_misses_only(server):
    a, b = store(server.url), store(server.url)
    try:
        with Load([a, b]) as load:
            time.sleep(1.5)
            server.kill_master()
            time.sleep(1.5)
            server.start()  # master and holder anew, empty
            time.sleep(2.0)
        check(load)
        toks = tokens(99, 2)
        deadline = time.monotonic() + 30
        while b.lookup(toks).chunks_by_tier.get(TierName.REMOTE) != 2:
            assert time.monotonic() < deadline, "no hit through the store after it came back"
            a.put(toks, make_kv(toks))
            a.flush(5)
            time.sleep(0.3)
        out = torch.zeros_like(make_kv(toks))
        assert b.get(toks, out) == len(toks) and same_bytes(out, make_kv(toks))
    finally:
        assert a.close(timeout=15) and b.close(timeout=15)
