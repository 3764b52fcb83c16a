"""Chunks on disk that no request has named since this engine started, named in its KV
events from their slots' token records: this engine's disk tier at start and other engines'
segments of a shared directory, as this engine's follower sees them come and go (every
engine that can load such a chunk advertises it). vLLM takes a connector's events only
after a step it ran, so a restarted engine publishes its disk from its first request on.

Headers are read (4 KiB each, read only) on a thread of this class's own; the scheduler's
step only copies the disk tier's chunk list at the first take (``StorageEvents.start``)
and takes what was found (``drain``, a bounded share per step). Naming a chunk costs about
17-35 us of Python (vLLM's hashes of its blocks), which holds the interpreter's lock the
scheduler's step needs too: the thread rests after each batch, three times as long as the
batch took, whatever news comes meanwhile, so it takes at most a quarter of a core
(100,000 chunks: about 14 s to name). While ``FOUND_LIMIT`` chunks wait for vLLM to take
them (an idle engine takes none), it reads nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.chunk_records import ChunkHashing, record_blocks
from kvtier.connector.scheduler.events import ChunkBlocks
from kvtier.io.format import HeaderError, decode_header
from kvtier.io.guarded import start_thread
from kvtier.io.token_record import read_record
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.slot_headers import read_headers
from kvtier.shared.followed import OtherChunk

log = logging.getLogger("kvtier")
QUEUE_LIMIT = 1 << 20  # headers waiting to be read; past it the newest are not read
FOUND_LIMIT = 16384  # chunks found and not yet taken; past it no more headers are read
ADD_BATCH = 4096  # reads of a listing queued under the lock at a time
BATCH = 512  # headers read at a time (about 20 ms of naming with blocks of 16 tokens)
Listen = Callable[[Callable[[ChunkKey, OtherChunk | None], None]], list[OtherChunk]]
DUTY = 0.25  # the share of one core the reads may take: a batch is followed by a rest


@dataclass(frozen=True, slots=True)
class Found:
    """A chunk named by its record (``blocks``; None: no other segment, or with ``remote``
    the store, holds it any more), held by this engine's disk, (``shared``) another
    engine's segment, or (``remote``) the remote store."""

    key: ChunkKey
    blocks: ChunkBlocks | None
    shared: bool
    remote: bool = False


def take_all(found: deque[Found], limit: int | None = None) -> list[Found]:
    """What ``found`` holds (at most its first ``limit``), taken out oldest first (another
    thread may append meanwhile)."""
    taken: list[Found] = []
    while found and (limit is None or len(taken) < limit):
        taken.append(found.popleft())
    return taken


@dataclass(frozen=True, slots=True)
class _Read:
    key: ChunkKey
    path: int
    writer: str
    slot: int  # local slot of that writer's files on ``path``
    shared: bool


class StorageEvents:
    """Contract: ``start(own, listen)`` begins (once vLLM hashes blocks: at its first take
    of events) to read the header of each chunk of ``own`` ((key, slot) of this engine's
    disk tier, as ``own_writer``'s segment holds them) and, with ``listen`` (rank 0's
    ``SharedView.listen``, called on the thread), of each chunk other segments hold, then
    of each they gain; a chunk they lose is reported gone; ``add_own(own)`` reads more of
    this engine's (a disk path's, back into service). ``drain(limit)`` returns what was
    found since the last call (at most ``limit``), in order. A header that cannot be read,
    is not the chunk's, or holds no record naming its key (``record_blocks``) finds nothing
    (counted in ``unnamed``). At most ``QUEUE_LIMIT`` headers wait: past it the newest are
    not read (``dropped``). A loss waits once however often it is told (until a read of the
    chunk is queued after it: a loss told after that read waits after it), and only for a chunk
    named (found, and no loss of it found since) or being read: a loss of any other names
    nothing anyone was told, and is dropped, so that an idle engine whose reads wait queues
    no more losses than the chunks it named and the reads waiting. What the follower tells
    while other segments' chunks are listed waits, then follows the listing in the order it
    came (a chunk lost right after it was listed is read, then lost). ``close()`` stops the
    thread.
    """

    def __init__(self, roots: Sequence[str], namespace: Namespace, own_writer: str,
                 stride: int, geometry: KVGeometry, hashing: ChunkHashing) -> None:
        self._roots, self._namespace, self._own = list(roots), namespace, own_writer
        self._stride, self._geometry, self._hashing = stride, geometry, hashing
        self._digest = namespace.digest()
        self.unnamed = self.dropped = 0
        self._todo: deque[_Read | ChunkKey] = deque()  # a key alone: gone from other segments
        self._losses: set[ChunkKey] = set()  # the losses in ``_todo``
        self._reading: Counter[ChunkKey] = Counter()  # reads in ``_todo`` or being read
        self._told: set[ChunkKey] = set()  # found, and no loss of it found since
        self._found: deque[Found] = deque()
        self._listing = False  # other segments' chunks being listed: their news waits
        self._early: list[_Read | ChunkKey] = []  # the follower's news while listing
        self._wake = threading.Condition()  # news for the thread: work, or close (reentrant)
        self._closing = threading.Event()  # the only end of a rest
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, own: Sequence[tuple[ChunkKey, int]], listen: Listen | None) -> bool:
        """Start the thread; False when it could not start (tried again at a later call)."""
        thread = threading.Thread(target=self._run, args=(own, listen),
                                  name="kvtier-storage-events", daemon=True)
        if start_thread(thread):
            self._thread = thread
        return self._thread is not None

    def drain(self, limit: int | None = None) -> list[Found]:
        return take_all(self._found, limit)

    def close(self) -> None:
        self._closing.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _other(self, chunk: OtherChunk) -> _Read:
        return _Read(chunk.key, chunk.path, chunk.writer, chunk.slot, True)

    def _changed(self, key: ChunkKey, chunk: OtherChunk | None) -> None:
        """The follower's news (on its refresh thread, under its view's lock); while the
        listing is added, news waits to follow it."""
        item = key if chunk is None else self._other(chunk)
        with self._wake:
            if self._listing:
                self._early.append(item)
                return
        self._add([item])

    def _add(self, items: list[_Read | ChunkKey]) -> None:
        with self._wake:
            room, kept = max(0, QUEUE_LIMIT - len(self._todo)), []
            for item in items:
                if isinstance(item, _Read):  # a read past the room is dropped
                    if not room:
                        self.dropped += 1
                        continue
                    room -= 1
                    self._reading[item.key] += 1
                    self._losses.discard(item.key)  # a loss after this read queues anew
                elif item in self._losses:  # a loss goes in once while it waits: a writer
                    continue  # starting its log over and over queues no more than its chunks
                elif item not in self._told and not self._reading[item]:
                    continue  # nothing was, or will be, said of it
                else:
                    self._losses.add(item)
                kept.append(item)
            self._todo.extend(kept)
            self._wake.notify()

    def add_own(self, own: Sequence[tuple[ChunkKey, int]]) -> None:
        """Read the records of more chunks (key, slot) of this engine's disk tier."""
        paths = len(self._roots)
        self._add([_Read(key, slot % paths, self._own, slot // paths, False) for key, slot in own])

    def _begin(self, own: Sequence[tuple[ChunkKey, int]], listen: Listen | None) -> None:
        self.add_own(own)
        if listen is None:
            return
        with self._wake:  # never held around ``listen``: the view's lock comes first
            self._listing = True
        reads: list[_Read | ChunkKey] = []
        try:
            reads += [self._other(chunk) for chunk in listen(self._changed)]
        finally:  # a batch at a time: the follower's news (under its view's lock, which a
            for start in range(0, len(reads), ADD_BATCH):  # step's lookup waits on) never
                self._add(reads[start:start + ADD_BATCH])  # waits for the whole listing
            with self._wake:  # the news since the listing follows it, in the order it came
                self._listing, early, self._early = False, self._early, []
                self._add(early)

    def _run(self, own: Sequence[tuple[ChunkKey, int]], listen: Listen | None) -> None:
        try:
            self._begin(own, listen)
        except Exception as exc:  # a hint lost, never the engine
            log.warning("kvtier: listing chunks on disk for KV events failed: %r", exc)
        while not self._closing.is_set():
            if len(self._found) >= FOUND_LIMIT:  # vLLM takes none now (an idle engine)
                self._closing.wait(0.05)
                continue
            with self._wake:
                while not self._todo and not self._closing.is_set():
                    self._wake.wait()
                batch = [self._todo.popleft() for _ in range(min(BATCH, len(self._todo)))]
                self._losses.difference_update(i for i in batch if not isinstance(i, _Read))
            if not batch:
                continue
            started, found = time.monotonic(), []
            try:
                found = self._read(batch)
            except Exception as exc:  # a hint lost, never the engine
                log.warning("kvtier: reading token records for KV events failed: %r", exc)
            self._over(batch, found)
            self._found.extend(found)
            # rest, so that the step keeps the interpreter most of the time: news of the
            # follower only queues work, it does not cut the rest short
            self._closing.wait((time.monotonic() - started) * (1 / DUTY - 1))

    def _over(self, batch: list[_Read | ChunkKey], found: list[Found]) -> None:
        """``batch`` was read and ``found`` what it names, in order (a chunk named, then
        lost, is not named)."""
        with self._wake:
            for item in found:
                if item.blocks is None:
                    self._told.discard(item.key)
                else:
                    self._told.add(item.key)
            for read in batch:
                if isinstance(read, _Read):
                    self._reading[read.key] -= 1
                    if not self._reading[read.key]:
                        del self._reading[read.key]

    def _read(self, batch: list[_Read | ChunkKey]) -> list[Found]:
        """What ``batch`` finds, in its order but each chunk after its parent chunk (as vLLM
        publishes a prompt's blocks): each header read once, segment by segment."""
        wanted: dict[tuple[int, str], set[int]] = {}
        for item in batch:
            if isinstance(item, _Read):
                wanted.setdefault((item.path, item.writer), set()).add(item.slot)
        headers = {(path, writer): read_headers(self._roots[path], self._namespace.id, writer,
                                                self._stride, slots)
                   for (path, writer), slots in wanted.items()}
        found = []
        for item in batch:
            if not isinstance(item, _Read):
                found.append(Found(item, None, True))
                continue
            blocks = self._named(item.key, headers[(item.path, item.writer)].get(item.slot))
            if blocks is None:
                self.unnamed += 1
            else:
                found.append(Found(item.key, blocks, item.shared))
        return parents_first(found)

    def _named(self, key: ChunkKey, data: bytes | None) -> ChunkBlocks | None:
        if data is None:
            return None
        try:
            header = decode_header(data)
        except HeaderError:
            return None
        if header.namespace != self._digest or header.key != key:
            return None
        record = read_record(data, header.num_parts)
        if record is None:
            return None
        return record_blocks(record, key, self._geometry, self._namespace, self._hashing)


def parents_first(found: list[Found]) -> list[Found]:
    """``found`` with each chunk moved after the chunk before it in its prompt (the one
    whose last block hash is its parent), where both are between the same two chunks gone
    (whose places stay as they were); otherwise in the order given."""
    ordered: list[Found] = []
    start = 0
    for end in [i for i, f in enumerate(found) if f.blocks is None] + [len(found)]:
        run = [(f, f.blocks) for f in found[start:end] if f.blocks is not None]
        by_last = {blocks.hashes[-1]: n for n, (_, blocks) in enumerate(run)}
        done = [False] * len(run)
        for first in range(len(run)):
            chain: list[int] = []
            at: int | None = first
            while at is not None and not done[at]:
                done[at] = True
                chain.append(at)
                parent = run[at][1].parent
                at = None if parent is None else by_last.get(parent)
            ordered += [run[n][0] for n in reversed(chain)]
        ordered += found[end:end + 1]
        start = end + 1
    return ordered
