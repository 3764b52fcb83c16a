"""What an engine's scheduler side publishes, recorded: a stand-in for ``VllmEvents`` and a
wait for a number of events (tests of the remote store's chunks in KV events)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvtier.connector.vllm_events import VllmHashing
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import BLOCK

HASHING = VllmHashing(SimpleNamespace(cache_config=SimpleNamespace(
    prefix_caching_hash_algo="sha256")), BLOCK)


class Recorded:
    """A stand-in for ``VllmEvents``: (kind, medium, hashes, tokens, remote) of each."""

    extra_keys = HASHING.extra_keys

    def stored(self, blocks, medium, remote=False):
        return [("stored", medium, blocks.hashes, blocks.tokens.tolist(), remote)]

    def removed(self, blocks, medium, remote=False):
        return [("removed", medium, blocks.hashes, None, remote)]


def events_until(engine: Engine, count: int, timeout: float = 15.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, got
        got += engine.scheduler.take_events()
        time.sleep(0.02)
    return got
