"""The sources of chunks named from token records (``storage_events.py``,
``remote_events.py``) and the feed that hands them to vLLM (``event_feed.py``) stay cheap,
bounded and truthful: an idle engine's backlog is bounded and handed on a share per step,
a removal is never dropped, a reader's rest is not cut short by news, a store's refusal to
answer is no loss, and a chunk of two holders is published for both."""

import threading
import time
from array import array
from collections import Counter
from types import SimpleNamespace

from kvtier.connector.scheduler import event_feed as feed_module
from kvtier.connector.scheduler import remote_events as remote_module
from kvtier.connector.scheduler import storage_events as storage_module
from kvtier.connector.scheduler.event_feed import EventFeed
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.remote_events import RemoteEvents
from kvtier.connector.scheduler.storage_events import Found, StorageEvents
from kvtier.connector.vllm_events import VllmHashing
from kvtier.io.token_record import encode_record
from kvtier.keys import ChunkKey, block_hash_chunk_key
from kvtier.shared.followed import OtherChunk
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO
from tests.helpers.vllm_requests import vllm_chain

NS = GEO.namespace("m", "", 1, 0)
HASHING = VllmHashing(SimpleNamespace(cache_config=SimpleNamespace(
    prefix_caching_hash_algo="sha256")), BLOCK)


class Factory:
    """A stand-in for ``VllmEvents``: (kind, medium, remote, last hash, parent)."""

    def extra_keys(self, request, start, stop):
        return None

    def stored(self, blocks, medium, remote=False):
        return [("stored", medium, remote, blocks.hashes[-1], blocks.parent)]

    def removed(self, blocks, medium, remote=False):
        return [("removed", medium, remote, blocks.hashes[-1], None)]


class Takes:
    """A stand-in for a source: one list of ``Found`` a drain, at most ``limit`` of it."""

    unnamed = dropped = 0
    started = False

    def __init__(self, takes):
        self._takes = [list(t) for t in takes]

    def start(self, *args):
        self.started = True
        return True

    def drain(self, limit=None):
        if not self._takes:
            return []
        take = self._takes[0]
        out, self._takes[0] = take[:limit], take[limit:] if limit is not None else []
        if not self._takes[0]:
            self._takes.pop(0)
        return out

    def close(self):
        pass


def blocks(n: int, parent: int | None) -> ChunkBlocks:
    return ChunkBlocks((b"h%d-0" % n, b"h%d" % n), None if parent is None else b"h%d" % parent,
                       array("i", [n]))


def key(n: int) -> ChunkKey:
    return ChunkKey(b"k%02d" % n * 4)


def feed(storage, remote, disk=None) -> EventFeed:
    counters = Counter()
    indexes = {} if disk is None else {TierName.DISK: disk}
    return EventFeed(KVEvents(GEO, Factory(), counters), storage, remote,
                     SimpleNamespace(indexes=indexes), None, counters)


def test_a_chunk_in_a_segment_and_in_the_store_is_published_for_both():
    storage = Takes([[Found(key(2), blocks(2, 1), shared=True)],
                     [Found(key(1), blocks(1, None), shared=True)]])
    remote = Takes([[Found(key(2), blocks(2, 1), shared=False, remote=True)], []])
    f = feed(storage, remote)
    assert f.take() == []  # both wait for chunk 1
    got = f.take()
    assert sorted(e[2] for e in got if e[0] == "stored" and e[3] == b"h2") == [False, True]


def test_a_child_waits_while_its_parent_on_this_engines_disk_was_evicted_meanwhile():
    """Chunks 1 and 2 were listed on this engine's disk; chunk 1 was evicted before its
    record was read: it publishes nothing, so chunk 2 must not go out without its parent."""
    disk = SlotIndex(8, make_policy("lru"))
    disk.adopt(key(2), 1)
    storage = Takes([[Found(key(2), blocks(2, 1), shared=False)],
                     [Found(key(1), blocks(1, None), shared=False)]])
    f = feed(storage, None, disk)
    assert f.take() == []
    assert f.take() == [] and f.waiting == 1


def test_an_idle_engines_backlog_is_handed_on_a_bounded_share_a_take(monkeypatch):
    monkeypatch.setattr(feed_module, "TAKE_LIMIT", 10)
    storage = Takes([[Found(key(n), blocks(n, None), shared=True) for n in range(25)]])
    f = feed(storage, None)
    assert [len(f.take()) for _ in range(4)] == [10, 10, 5, 0]


# -- the remote store's log ----------------------------------------------------------------

TOKENS = list(range(3000, 3000 + CHUNK))
LOGGED = block_hash_chunk_key(NS, vllm_chain(TOKENS, BLOCK)[-1])


class Log:
    """A store's log and presence: ``entries`` logged; ``held`` answers ``exists_answered``
    (for every key, a list, or None: the round trip failed); reads and questions counted."""

    keeps_records, down = True, False

    def __init__(self, entries, held=True):
        self.entries, self.held, self.reads, self.asked = list(entries), held, 0, []

    def read_records(self, after, count):
        self.reads += 1
        start = 0 if after == b"0" else int(after)
        taken = self.entries[start:start + count]
        return (b"%d" % (start + len(taken)) if taken else after), taken

    def exists_answered(self, keys):
        self.asked.append(list(keys))
        if isinstance(self.held, bool):
            return [self.held] * len(keys)
        return None if self.held is None else list(self.held)


def entry() -> tuple[bytes, bytes]:
    return bytes(LOGGED), encode_record(b"", array("i", TOKENS))


def test_a_chunk_logged_again_and_again_is_named_once():
    events = RemoteEvents(Log([entry()] * 2000), NS, GEO, HASHING)
    events._follow()
    assert len(events.drain()) == 1


def test_a_logged_chunk_is_named_only_once_the_store_says_it_holds_it():
    log = Log([entry()], held=None)  # the question failed: read again from the same entry
    events = RemoteEvents(log, NS, GEO, HASHING)
    events._follow()
    assert events.drain() == [] and events._after == b"0"
    log.held = [False]  # evicted long ago, logged still
    events._follow()
    assert events.drain() == [] and events._after == b"1"
    log.entries.append(entry())  # written again, logged again
    log.held = [True]
    events._follow()
    assert [f.key for f in events.drain()] == [LOGGED]


def test_a_key_the_store_refused_to_answer_for_is_not_reported_gone():
    """A cluster's redirect (ASK, MOVED, TRYAGAIN) while a slot moves is no loss."""
    log = Log([entry()])
    events = RemoteEvents(log, NS, GEO, HASHING)
    events._follow()
    events.drain()
    for answer in ([None], None):
        log.held = answer
        events._check()
        assert events.drain() == []
    log.held = [False]
    events._check()
    assert [(f.key, f.blocks) for f in events.drain()] == [(LOGGED, None)]


def test_a_redirect_in_a_redis_reply_is_no_answer_for_that_key():
    from redis.exceptions import AskError

    from kvtier.remote.redis_tier import RedisTier

    tier = RedisTier("redis+cluster://127.0.0.1:1", NS, 64)
    tier._run = lambda what, commands: [AskError("1234 127.0.0.1:7001"), 1, 0][:len(commands)]
    assert tier.exists_answered([key(1), key(2), key(3)]) == [None, True, False]
    tier.close()


def test_the_log_is_not_read_while_vllm_takes_nothing(monkeypatch):
    monkeypatch.setattr(remote_module, "FOUND_LIMIT", 1)
    log = Log([entry()])
    events = RemoteEvents(log, NS, GEO, HASHING)
    events._follow()
    reads = log.reads
    events._follow()
    assert log.reads == reads  # one chunk waits: nothing read
    events.drain()
    events._follow()
    assert log.reads == reads + 1


def logged_entry(tokens: list[int]) -> tuple[ChunkKey, tuple[bytes, bytes]]:
    chunk = block_hash_chunk_key(NS, vllm_chain(tokens, BLOCK)[-1])
    return chunk, (bytes(chunk), encode_record(b"", array("i", tokens)))


def test_a_chunk_the_engine_found_lost_is_removed_at_once_and_named_again_once_logged():
    """A read that found the chunk missing or damaged, or a sampled check that removed it:
    its removal goes out at the next take, with no check of the store (every 10 s over up
    to 65,536 chunks), and a later entry of the log names it again. Found by a review."""
    log = Log([entry()])
    remote = RemoteEvents(log, NS, GEO, HASHING)
    f = feed(None, remote)
    f._started = True  # the test is the thread
    remote._follow()
    assert [e[:3] for e in f.take()] == [("stored", "STORAGE", True)]
    f.remote_lost([LOGGED])
    assert [e[:3] for e in f.take()] == [("removed", "STORAGE", True)]
    remote._forget_lost()
    assert f.take() == [] and log.asked == [[LOGGED]]  # the store was not asked
    log.entries.append(entry())  # written again, logged again
    remote._follow()
    assert [e[:3] for e in f.take()] == [("stored", "STORAGE", True)]


def test_a_naming_not_taken_when_the_loss_was_told_is_followed_by_its_removal():
    log = Log([entry()])
    remote = RemoteEvents(log, NS, GEO, HASHING)
    f = feed(None, remote)
    f._started = True
    remote._follow()  # named, not taken yet: the store said it held it a moment ago
    f.remote_lost([LOGGED])
    assert [e[:3] for e in f.take()] == [("stored", "STORAGE", True)]
    remote._forget_lost()
    assert [e[:3] for e in f.take()] == [("removed", "STORAGE", True)]


def test_a_chunk_lost_and_named_again_is_asked_about_first(monkeypatch):
    """The store answered that it held a chunk just before its removal ran (a sampled
    check's removal runs in the background): the next check asks about it first, not after
    every chunk named before it."""
    monkeypatch.setattr(remote_module, "CHECK_KEYS", 2)
    older = [logged_entry(list(range(4000 + CHUNK * n, 4000 + CHUNK * (n + 1))))
             for n in range(3)]
    log = Log([e for _, e in older] + [entry()])
    remote = RemoteEvents(log, NS, GEO, HASHING)
    remote._follow()
    remote.lost([LOGGED])
    remote._forget_lost()
    log.entries.append(entry())
    remote._follow()
    assert LOGGED in remote._named
    remote._check()
    assert log.asked[-1] == [LOGGED, older[0][0]]


# -- this engine's disk and other segments -------------------------------------------------

def test_a_full_queue_drops_reads_never_losses(monkeypatch):
    monkeypatch.setattr(storage_module, "QUEUE_LIMIT", 2)
    s = StorageEvents(["/nonexistent"], NS, "w", 4096, GEO, HASHING)
    read = storage_module._Read(key(1), 0, "x", 0, True)
    s._add([read, read])
    s._add([read])  # past the room: dropped
    s._changed(key(1), None)  # another segment lost chunk 1, being read: kept
    s._changed(key(3), None)  # chunk 3, never named nor read: nothing to say
    assert s.dropped == 1 and list(s._todo) == [read, read, key(1)]


def test_a_loss_told_again_and_again_while_it_waits_is_queued_once():
    """A co-writer starting its log over and over, while this engine is idle (vLLM takes
    nothing), queues no more losses than it has chunks."""
    s = StorageEvents(["/nonexistent"], NS, "w", 4096, GEO, HASHING)
    s._add([storage_module._Read(key(n), 0, "x", n, True) for n in range(20)])
    for _ in range(10):
        for n in range(20):
            s._changed(key(n), None)
    assert len(s._todo) == 40


def test_news_told_while_the_listing_is_queued_follows_it_in_order():
    """Another segment loses a listed chunk right after the listing, before its read was
    queued (the refresh thread is free once ``listen`` returned), then gains it again: the
    loss is kept, after the listed chunk's read (whose header may still name it: a gone
    writer's files stay until gc), and the gain after the loss. Found by a review."""
    listed = OtherChunk("other-0", 0, 3, key(1), 0, 100)
    again = OtherChunk("other-1", 0, 4, key(1), 0, 100)

    class Listing(list):
        def __iter__(self):  # the refresh thread's news, as the listing is walked
            self.listener(key(1), None)
            self.listener(key(1), again)
            return super().__iter__()

    def listen(listener):
        listing = Listing([listed])
        listing.listener = listener
        return listing

    s = StorageEvents(["/nonexistent"], NS, "w", 4096, GEO, HASHING)
    s._begin([], listen)
    assert list(s._todo) == [s._other(listed), key(1), s._other(again)]
    s._changed(key(2), None)  # a loss past the listing, of a chunk never named: dropped
    assert len(s._todo) == 3


def test_listing_the_chunks_on_disk_and_in_other_segments_runs_on_the_readers_thread():
    asked = []

    def listen(listener):
        asked.append(threading.current_thread())
        return []

    s = StorageEvents(["/nonexistent"], NS, "w", 4096, GEO, HASHING)
    s.start([(key(1), 0)], listen)
    deadline = time.monotonic() + 5
    while not asked:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.close()
    assert asked == [s._thread] and s.unnamed == 1  # chunk 1's header: not there


def test_the_readers_rest_is_not_cut_short_by_the_followers_news(monkeypatch):
    """After each batch the thread rests three times as long as the batch took (DUTY),
    whatever news comes. An upper bound only: a loaded machine makes fewer batches."""
    work = 0.02
    batches = []

    def read(self, batch):
        batches.append(time.monotonic())
        time.sleep(work)  # stands for naming a batch of chunks
        return []

    monkeypatch.setattr(StorageEvents, "_read", read)
    s = StorageEvents(["/nonexistent"], NS, "w", 4096, GEO, HASHING)
    s._todo.extend(key(n % 50) for n in range(400 * storage_module.BATCH))
    stop = threading.Event()

    def news():
        while not stop.is_set():
            s._changed(key(99), None)
            time.sleep(0.002)

    thread = threading.Thread(target=news, daemon=True)
    thread.start()
    s.start([], None)
    time.sleep(1.0)
    stop.set()
    s.close()
    thread.join()
    assert len(batches) <= 1.0 / (work / storage_module.DUTY) * 2  # 12.5 a second at most


def test_a_refused_chunk_carried_over_holds_back_no_batch_of_old_entries():
    """A chunk the store will not answer for is asked about again each round; a later
    batch of 512 entries naming only chunks already named left that chunk alone in the
    round, refused again, taken for no answer at all: the log stuck there. Found by a
    review."""
    refused, named, last = (ChunkKey(bytes([c]) * 16) for c in b"xyz")
    log = [refused, named] + [named] * (2 * remote_module.BATCH) + [last]

    class Store:
        def read_records(self, after, count):
            start = int(after)
            entries = [(bytes(k), b"record") for k in log[start:start + count]]
            return str(start + len(entries)).encode(), entries

        def exists_answered(self, keys):
            return [None if k == refused else True for k in keys]

    events = RemoteEvents(Store(), NS, GEO, HASHING)
    events._new = lambda entries: ({ChunkKey(k): "blocks" for k, _ in entries
                                    if ChunkKey(k) not in events._named}, 0)
    for _ in range(4):
        events._follow()
    assert [f.key for f in events.drain()] == [named, last]
