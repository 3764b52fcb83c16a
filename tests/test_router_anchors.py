"""A chunk named from its token record before the chunk before it reaches the router only
after it (``scheduler/anchors.py``), against the real vllm-router: it drops a block whose
parent it has not seen and never takes it up again, so an engine whose events came out of
prompt order would lose the credit of everything past a prompt's first chunk.

Two stand-in engines behind vllm-router's ``kv_aware`` policy, each publishing vLLM's KV
event batches on its own ZMQ socket. Engine A holds a prompt's first block in GPU memory
(credit 1); engine B holds the prompt's two chunks (four blocks) on disk (``STORAGE`` at
0.4 a block), found second chunk first in two takes of its ``EventFeed``. Both anchored,
B's 1.6 outweighs A's 1; with the second chunk dropped, A's 1 outweighs B's 0.8."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from array import array
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvtier.connector.scheduler import event_feed
from kvtier.connector.scheduler.event_feed import EventFeed
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.storage_events import Found
from kvtier.connector.vllm_events import VllmEvents
from kvtier.keys import ChunkKey
from tests.helpers.router_fleet import BLOCK, SERVED, Engine, free_port, have_router, router_argv, stop
from tests.helpers.scheduler_side import GEO
from tests.helpers.stand_in_engine import StandInEngine
from tests.helpers.subprocesses import die_with_parent
from tests.helpers.vllm_requests import vllm_chain

pytestmark = pytest.mark.skipif(not have_router(), reason="vllm-router is not installed")
TOKENS = list(range(3000, 3000 + 4 * BLOCK))


class FoundInTakes:
    """A stand-in for ``StorageEvents``: hands out one list of found chunks a drain."""

    unnamed = dropped = 0
    started = False

    def __init__(self, takes: list[list[Found]]) -> None:
        self._takes = takes

    def start(self, own, listen) -> bool:
        self.started = True
        return True

    def drain(self, limit: int | None = None) -> list[Found]:
        return self._takes.pop(0) if self._takes else []


def blocks(hashes: list[bytes], first: int, count: int) -> ChunkBlocks:
    return ChunkBlocks(tuple(hashes[first:first + count]), hashes[first - 1] if first else None,
                       array("i", TOKENS[first * BLOCK:(first + count) * BLOCK]))


class Side:
    """One stand-in engine and its event publisher (vLLM's own)."""

    def __init__(self) -> None:
        self.http = StandInEngine()
        port = free_port()
        self.publisher = ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{port}")
        self.engine = Engine(self.http.url, f"tcp://127.0.0.1:{port}", None)

    def publish(self, events: list) -> None:
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.publisher.shutdown()
        self.http.close()


def routed_to(router: str, sides: dict[str, Side], prompt: list[int]) -> str:
    body = json.dumps({"model": SERVED, "prompt": prompt, "max_tokens": 1}).encode()
    before = {name: len(side.http.arrived) for name, side in sides.items()}
    request = urllib.request.Request(f"{router}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        reply.read()
    (name,) = [name for name, side in sides.items() if len(side.http.arrived) > before[name]]
    return name


def until_routed(router: str, sides: dict[str, Side], name: str, tokens: list[int],
                 factory: VllmEvents, timeout: float = 20.0) -> None:
    """Publish ``tokens``' first block on ``name`` (GPU) until a request for them goes there:
    the router hears ``name`` and has read everything it published before."""
    hashes = vllm_chain(tokens, BLOCK)
    deadline = time.monotonic() + timeout
    while True:
        sides[name].publish(factory.stored(ChunkBlocks(
            (hashes[0],), None, array("i", tokens[:BLOCK])), "GPU"))
        time.sleep(0.2)
        if routed_to(router, sides, [*tokens, 1]) == name:  # a whole block and one token more
            return
        assert time.monotonic() < deadline, f"the router never heard engine {name}"


@pytest.fixture
def fleet(tmp_path):
    sides = {"a": Side(), "b": Side()}
    port, metrics = free_port(), free_port()
    argv = router_argv("kv_aware", port, metrics, [s.engine for s in sides.values()],
                       extra=("--kv-penalty-disk", "0.4"))
    with open(tmp_path / "router.log", "wb") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/readiness", timeout=2).read()
                break
            assert router.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "router.log").read_text()[-3000:]
            time.sleep(0.2)
        yield url, sides
    finally:
        stop(router)
        for side in sides.values():
            side.close()


@pytest.mark.parametrize("anchored", [True, False], ids=["in-prompt-order", "as-found"])
def test_a_chunk_found_before_its_parent_is_published_after_it(fleet, monkeypatch, anchored):
    router, sides = fleet
    if not anchored:  # the router's side of the contract: unanchored blocks are dropped
        monkeypatch.setattr(event_feed.Anchors, "order",
                            lambda self, found, publish, published: [publish(f) for f in found])
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype="float32")
    factory = VllmEvents(SimpleNamespace(cache_config=SimpleNamespace(
        prefix_caching_hash_algo="sha256")), SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]), BLOCK)
    hashes = vllm_chain(TOKENS, BLOCK)
    first = Found(ChunkKey(b"first"), blocks(hashes, 0, 2), shared=True)
    second = Found(ChunkKey(b"second"), blocks(hashes, 2, 2), shared=True)
    feed = EventFeed(KVEvents(GEO, factory, Counter()), FoundInTakes([[second], [first]]), None,
                     SimpleNamespace(indexes={}), None, Counter())
    until_routed(router, sides, "a", [7] * BLOCK, factory)
    until_routed(router, sides, "b", [8] * BLOCK, factory)
    sides["a"].publish(factory.stored(blocks(hashes, 0, 1), "GPU"))
    for _ in range(2):  # the second chunk's take, then the first's
        sides["b"].publish(feed.take())
    until_routed(router, sides, "a", [9] * BLOCK, factory)  # a's events read: b's were before
    until_routed(router, sides, "b", [10] * BLOCK, factory)
    assert routed_to(router, sides, [*TOKENS, 1, 2]) == ("b" if anchored else "a")
