"""The remote store's chunks named in this engine's KV events: every engine that can load a
chunk from the store advertises it, whichever engine wrote it.

Each engine appends the token record of each chunk it writes to the store's log of them
(``RemoteTier.append_records``: a Valkey/Redis stream, Mooncake Store's batches). Here a
thread follows that log from its oldest entry, names each chunk whose record's hashes make
its key (``record_blocks``) and that the store says it holds (the log outlives many of its
values: the store evicts them by its own rule), and asks the store now and then whether it
still holds the chunks it named: one it answers it lost (evicted, a restart) is reported
gone; one it refused to answer for (a cluster's slot moving) is not. What the engine learns
for certain on its own (a read of the chunk answered missing or damaged, or a sampled check
removed it as wrong) is published at once by the feed and told here (``lost``): the chunk
is forgotten, so that a later entry names it again, and asked about first should it be
named again meanwhile. Nothing here runs on the scheduler's step but ``drain`` and
``lost``; like ``StorageEvents`` the thread rests three times as long as it works, and
reads nothing more while ``FOUND_LIMIT`` chunks wait for vLLM to take them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.chunk_records import ChunkHashing, record_blocks
from kvtier.connector.scheduler.events import ChunkBlocks
from kvtier.connector.scheduler.storage_events import DUTY, FOUND_LIMIT, Found, take_all
from kvtier.io.guarded import start_thread
from kvtier.io.token_record import decode_record
from kvtier.keys import KEY_BYTES, ChunkKey, Namespace
from kvtier.remote.base import RECORD_LOG, RemoteTier
from kvtier.remote.known import KnownKeys

log = logging.getLogger("kvtier")
FOLLOW_EVERY_S = 1.0  # how often the log is read for what it gained
CHECK_EVERY_S = 10.0  # how often named chunks are asked about
CHECK_KEYS = 1024  # chunks asked about at a time: one round trip
BATCH = 512  # log entries read at a time
UNANSWERED = BATCH  # chunks the store refused to answer for, asked about again (the rest: not)


class RemoteEvents:
    """Contract: ``start()`` (at the first take of events: vLLM hashes blocks only once its
    engine is up) starts the thread; ``drain(limit)`` returns what was found since the last
    call (at most ``limit``), in order: a chunk named (``Found`` with ``remote``), or gone
    (``blocks`` None). A chunk is named once, while the store holds it; at most
    ``RECORD_LOG`` are named at once: past it the oldest named is reported gone. Entries
    that name nothing (another shape, a key not of this size, a record that does not make
    its key) are counted in ``unnamed``. A store that fails a round trip, or refuses to
    answer for every key, costs this round only: the log is read again from the same entry.
    One that refuses to answer for some keys (a cluster's slot moving, or not served)
    has the log read on past them, and is asked about those again at each later round (at
    most ``UNANSWERED`` of them), so that one slot out of service for long holds no other
    chunk back. ``lost(keys)`` (on the scheduler's thread, whose feed published their
    removal): the thread forgets them at its next round (a naming of one still waiting is
    followed by its loss), and its next check asks first about those named again since.
    ``close()`` stops the thread."""

    def __init__(self, tier: RemoteTier, namespace: Namespace, geometry: KVGeometry,
                 hashing: ChunkHashing) -> None:
        self._tier, self._namespace, self._geometry, self._hashing = tier, namespace, geometry, hashing
        self._after = b"0"
        self._named = KnownKeys(RECORD_LOG)
        self._unanswered: dict[ChunkKey, ChunkBlocks] = {}  # asked about again next round
        self._found: deque[Found] = deque()
        self._lost: deque[ChunkKey] = deque(maxlen=RECORD_LOG)  # told by the scheduler side
        self._suspects = KnownKeys(CHECK_KEYS)  # lost: asked about first if named again
        self.unnamed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._checked = time.monotonic()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Start the thread; False when it could not start (tried again at a later call)."""
        thread = threading.Thread(target=self._run, name="kvtier-remote-events", daemon=True)
        if start_thread(thread):
            self._thread = thread
        return self._thread is not None

    def drain(self, limit: int | None = None) -> list[Found]:
        return take_all(self._found, limit)

    def lost(self, keys: Iterable[ChunkKey]) -> None:
        self._lost.extend(keys)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
                if time.monotonic() - self._checked >= CHECK_EVERY_S:
                    self._check()
            except Exception as exc:  # a hint lost, never the engine
                log.warning("kvtier: following the remote store's token records failed: %r",
                            exc)
            self._stop.wait(FOLLOW_EVERY_S)

    def _follow(self) -> None:
        """Read what the log gained, ``BATCH`` entries at a time, resting between; the
        chunks they name that the store holds are named."""
        while not self._stop.is_set() and len(self._found) < FOUND_LIMIT:
            started = time.monotonic()
            answer = self._tier.read_records(self._after, BATCH)
            # losses told before what was read was logged: a chunk lost, then written and
            # logged again, is named again
            self._forget_lost()
            if answer is None:
                return
            after, entries = answer
            fresh, unnamed = self._new(entries)
            new = {**self._unanswered, **fresh}
            held = self._tier.exists_answered(list(new)) if new else []
            if held is None:
                return  # the round trip failed: the same entries next round
            answered = dict(zip(new, held, strict=True))
            if fresh and all(answered[key] is None for key in fresh):
                return  # no answer for this round's chunks: the same entries next round
            self._unanswered = {}
            for (key, blocks), there in zip(new.items(), held, strict=True):
                if there:
                    self._name(key, blocks)
                elif there is None and len(self._unanswered) < UNANSWERED:
                    self._unanswered[key] = blocks
            self._after = after
            self.unnamed += unnamed  # counted once the round is over (once if read again)
            if len(entries) < BATCH:
                return
            self._stop.wait((time.monotonic() - started) * (1 / DUTY - 1))

    def _new(self, entries: list[tuple[bytes, bytes]]) -> tuple[dict[ChunkKey, ChunkBlocks], int]:
        """The chunks ``entries`` name that are not named already, each once; and how many
        entries name nothing."""
        new: dict[ChunkKey, ChunkBlocks] = {}
        unnamed = 0
        for key, data in entries:
            if ChunkKey(key) in self._named or ChunkKey(key) in new:
                continue
            record = decode_record(data) if len(key) == KEY_BYTES else None
            blocks = None if record is None else record_blocks(
                record, ChunkKey(key), self._geometry, self._namespace, self._hashing)
            if blocks is None:
                unnamed += 1
            else:
                new[ChunkKey(key)] = blocks
        return new, unnamed

    def _name(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        self._found.append(Found(key, blocks, False, remote=True))
        for gone in self._named.add(key):
            self._found.append(Found(gone, None, False, remote=True))

    def _forget_lost(self) -> None:
        """Forget the chunks the scheduler side said the store lost; one still named is
        reported gone too, after any naming of it not taken yet."""
        while self._lost:
            key = self._lost.popleft()
            if key in self._named:
                self._named.discard(key)
                self._found.append(Found(key, None, False, remote=True))
            self._suspects.add(key)

    def _check(self) -> None:
        """Ask the store about the chunks lost and named again since, then those named
        longest ago: those it answers it lost are gone."""
        self._checked = time.monotonic()
        first = [key for key in self._suspects if key in self._named]
        self._suspects.clear()
        asked = set(first)
        keys = first + [key for key in self._named.oldest(CHECK_KEYS - len(first))
                        if key not in asked]
        if not keys:
            return
        there = self._tier.exists_answered(keys)
        if there is None:
            return  # the round trip failed: nothing learnt
        for key, held in zip(keys, there, strict=True):
            if held is False:
                self._named.discard(key)
                self._found.append(Found(key, None, False, remote=True))
