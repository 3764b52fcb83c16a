"""What the Valkey/Redis tier's tests (tests/test_remote_redis.py, tests/test_redis_*.py) set
up alike: the namespace and chunk size of their tiers, a key and its chunk's bytes by number,
the names the tier stores a chunk's value and the log of token records under, a real server
or cluster run for as long as a ``with`` block (stopped however the block ends), and the
wait for a one-node cluster to come up."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.values import value_key
from tests.helpers.redis_server import RedisCluster, RedisServer

RAW = 64 * 1024
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
LOG = f"kvtier:log:{NS.digest().hex()}".encode()  # the log of token records, in NS
Store = TypeVar("Store", RedisServer, RedisCluster)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int, nbytes: int = RAW) -> np.ndarray:
    """The bytes of chunk ``i``: the same for the same ``i``, another chunk's for another."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def name(k: ChunkKey) -> bytes:
    """The store's key of chunk ``k``'s value, in NS."""
    return value_key("kvtier:", NS.digest(), k)


@contextmanager
def running(store: Store) -> Iterator[Store]:
    """``store`` started for the block, and stopped at its end, or when it fails to start."""
    try:
        yield store.start()
    finally:
        store.stop()


def wait_cluster(server: RedisServer) -> None:
    """Until the one-node cluster ``server`` says it is up (its slots assigned, or it restarted)."""
    client = server.client()
    deadline = time.monotonic() + 30
    while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "the one-node cluster never came up"
        time.sleep(0.05)
