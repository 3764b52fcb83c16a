"""Gets of the same prefix at once: a chunk one get is reading from disk into host memory
is waited for by the others (at most ``load_timeout``), never taken for a miss."""

import contextlib
import threading
from collections.abc import Iterator

import torch

from kvtier import KVStore
from kvtier.keys import ChunkKey
from kvtier.store.books import Books
from kvtier.store.staging import Stagings
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import LRUPolicy
from kvtier.tiers.stack import Location, StorePlan, TierStack
from tests.helpers.disk_helpers import failing_io, wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, SMALL, bookkeeping, make_kv, same_bytes
from tests.helpers.store import config, seq

DISK = TierName.DISK


@contextlib.contextmanager
def held(engine: FakeEngine) -> Iterator[None]:
    """The engine's jobs wait until the block ends (or ``release`` earlier)."""
    engine.hold()
    try:
        yield
    finally:
        engine.release()


def stored_on_disk(path, chunks: int) -> list[int]:
    """``chunks`` chunks of seq(0) written to disk under ``path``; their tokens."""
    tokens = seq(0, chunks)
    with KVStore(SMALL, config(path, host_chunks=16)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
    return tokens


class Reader:
    """A ``get`` of ``tokens`` on its own thread (after ``barrier``, if any)."""

    def __init__(self, store: KVStore, tokens: list[int], barrier: threading.Barrier | None = None):
        self.tokens, self.loaded, self.error = tokens, -1, None
        self._store, self._barrier = store, barrier
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        out = torch.zeros(SMALL.shape(len(self.tokens)), dtype=torch.bfloat16)
        if self._barrier is not None:
            self._barrier.wait()
        try:
            n = self._store.get(self.tokens, out)
            if not same_bytes(out[:, :, :n], make_kv(self.tokens)[:, :, :n]):
                raise AssertionError(f"wrong bytes in the {n} tokens served")
            self.loaded = n
        except BaseException as exc:
            self.error = exc

    def result(self) -> int:
        """Tokens loaded (every byte checked); generous bound on the wait: a hang fails."""
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the get never returned"
        if self.error is not None:
            raise self.error
        return self.loaded


def waiting(store: KVStore, tokens: list[int]) -> bool:
    """Whether a get waits for the staging of the first chunk of ``tokens`` (white-box)."""
    with bookkeeping(store):
        return store._fetcher.stagings.waited(store.keys(tokens)[0])


def settled(store: KVStore) -> None:
    """No pin, reservation or staging is left over."""
    with bookkeeping(store) as stack:
        assert len(store._fetcher.stagings) == 0, "a staging was never ended"
        for index in stack.indexes.values():
            census = index.census()
            assert census.pins == 0 and census.writing == 0, census


def test_two_gets_of_a_prefix_on_disk_only_both_get_all_of_it(tmp_path):
    tokens = stored_on_disk(tmp_path, 8)
    for _ in range(10):  # a restart each time: every chunk on disk only
        with KVStore(SMALL, config(tmp_path, host_chunks=16)) as store:
            assert store.lookup(tokens).chunks_by_tier == {DISK: 8}
            barrier = threading.Barrier(2)
            readers = [Reader(store, tokens, barrier) for _ in range(2)]
            assert [r.result() for r in readers] == [store.lookup(tokens).tokens] * 2
            assert store.stats().chunks_missed == 0
            settled(store)


def test_a_get_waits_for_the_read_another_get_started(tmp_path):
    tokens = stored_on_disk(tmp_path, 1)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path), io_engine=make) as store:
        with held(engines[0]):
            first = Reader(store, tokens)
            assert engines[0].started.acquire(timeout=30), "the first get's read never started"
            second = Reader(store, tokens)
            wait_until(lambda: waiting(store, tokens), "the second get did not wait for the read")
        assert first.result() == second.result() == CHUNK
        assert store.stats().chunks_loaded == {DISK: 1, TierName.HOST: 1}
        settled(store)


def test_a_get_waiting_for_a_read_that_fails_misses_cleanly(tmp_path, monkeypatch):
    tokens = stored_on_disk(tmp_path, 2)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path), io_engine=make) as store, \
            failing_io(monkeypatch, "slots-", calls=("preadv",)):  # once the drive answers
        with held(engines[0]):
            first = Reader(store, tokens)
            assert engines[0].started.acquire(timeout=30), "the first get's read never started"
            second = Reader(store, tokens)
            wait_until(lambda: waiting(store, tokens), "the second get did not wait for the read")
        assert first.result() == 0  # the read failed: the chunk is dropped
        assert second.result() == 0  # a miss, not a hang and not the bytes of a failed read
        assert store.stats().io_errors >= 1 and store.lookup(tokens).tokens == 0
        settled(store)


def test_a_get_waits_for_another_gets_read_at_most_load_timeout(tmp_path):
    tokens = stored_on_disk(tmp_path, 1)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, load_timeout=2), io_engine=make) as store:
        with held(engines[0]):  # a drive that does not answer
            first = Reader(store, tokens)
            assert engines[0].started.acquire(timeout=30), "the first get's read never started"
            second = Reader(store, tokens)  # begins well within the first's load_timeout
            assert first.result() == 0 and second.result() == 0  # each given up at load_timeout
            assert waiting(store, tokens), "the second get did not wait for the read"
        wait_until(lambda: len(store._fetcher.stagings) == 0, "the hung read's staging never ended")
        settled(store)


def test_gets_of_one_prefix_through_a_small_host_tier_never_hang(tmp_path):
    """Four threads read one prefix over and over through a host tier smaller than it:
    chunks are staged, evicted and staged again while others wait for them."""
    tokens = stored_on_disk(tmp_path, 8)
    errors: list[BaseException] = []
    with KVStore(SMALL, config(tmp_path, host_chunks=4)) as store:
        def loop() -> None:
            try:
                for _ in range(20):
                    Reader(store, tokens).result()  # every byte served checked
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=loop) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        assert not any(worker.is_alive() for worker in workers), "deadlock"
        assert errors == []
        settled(store)
        assert Reader(store, tokens).result() > 0


def test_more_gets_of_one_prefix_than_host_memory_stages_at_once_all_get_all_of_it(tmp_path):
    """Three gets at once of a prefix on disk through two host slots: a get whose every
    host slot the others hold (copying their chunks out, or reading them in) waits for one
    to be let go. It ended there, short of the prefix that is all cached. Found by a
    review."""
    tokens = stored_on_disk(tmp_path, 8)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        for _ in range(20):
            barrier = threading.Barrier(3)
            readers = [Reader(store, tokens, barrier) for _ in range(3)]
            assert [reader.result() for reader in readers] == [len(tokens)] * 3
        settled(store)


def test_a_staging_ends_only_by_its_own_plan():
    """A staging whose host slot went back before its ``end`` (a failed demotion) and was
    reserved again: its late ``end`` leaves the new staging in flight."""
    books = Books(TierStack([(TierName.HOST, SlotIndex(2, LRUPolicy()))]))
    stagings = Stagings(books)
    key = ChunkKey(bytes(16))
    first, second = (StorePlan(key, Location(TierName.HOST, slot)) for slot in (0, 1))
    with books.held():
        stagings.begin(first)
        stagings.begin(second)
        stagings.end(first)
        assert stagings.busy(key) and len(stagings) == 1
    assert stagings.wait(key, 0) is False  # in flight: no wait past the timeout
    with books.held():
        stagings.end(second)
        assert not stagings.busy(key) and len(stagings) == 0
    assert stagings.wait(key, None) is True  # nothing in flight: no wait at all
