"""The remote store's chunks named in this engine's KV events: every engine that can load a
chunk from the store advertises it, whichever engine wrote it.

Each engine appends the token record of each chunk it writes to the store's log of them
(``RemoteTier.append_records``: a Valkey/Redis stream). Here a thread follows that log from
its oldest entry, names each chunk whose record's hashes make its key (``record_blocks``),
and asks the store now and then whether it still holds the chunks it named: one it lost
(evicted, a restart) is reported gone. Nothing here runs on the scheduler's step but
``drain``; like ``StorageEvents`` the thread rests three times as long as it works.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.chunk_records import ChunkHashing, record_blocks
from kvtier.connector.scheduler.storage_events import DUTY, Found, take_all
from kvtier.io.token_record import decode_record
from kvtier.keys import KEY_BYTES, ChunkKey, Namespace
from kvtier.remote.base import RECORD_LOG, RemoteTier
from kvtier.remote.known import KnownKeys

log = logging.getLogger("kvtier")
FOLLOW_EVERY_S = 1.0  # how often the log is read for what it gained
CHECK_EVERY_S = 10.0  # how often named chunks are asked about
CHECK_KEYS = 1024  # chunks asked about at a time: one round trip
BATCH = 512  # log entries read at a time


class RemoteEvents:
    """Contract: ``start()`` (at the first take of events: vLLM hashes blocks only once its
    engine is up) starts the thread; ``drain()`` returns what was found since the last
    call, in order: a chunk named (``Found`` with ``remote``), or gone (``blocks`` None).
    At most ``RECORD_LOG`` chunks are named at once: past it the oldest named is reported
    gone. Entries that name nothing (another shape, a key not of this size, a record that
    does not make its key) are counted in ``unnamed``. A store that fails a round trip
    costs this round only. ``close()`` stops the thread."""

    def __init__(self, tier: RemoteTier, namespace: Namespace, geometry: KVGeometry,
                 hashing: ChunkHashing) -> None:
        self._tier, self._namespace, self._geometry, self._hashing = tier, namespace, geometry, hashing
        self._after = b"0"
        self._named = KnownKeys(RECORD_LOG)
        self._found: deque[Found] = deque()
        self.unnamed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._checked = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtier-remote-events",
                                        daemon=True)
        self._thread.start()

    def drain(self) -> list[Found]:
        return take_all(self._found)

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
        """Read what the log gained, ``BATCH`` entries at a time, resting between."""
        while not self._stop.is_set():
            started = time.monotonic()
            answer = self._tier.read_records(self._after, BATCH)
            if answer is None:
                return
            self._after, entries = answer
            for key, record in entries:
                self._name(key, record)
            if len(entries) < BATCH:
                return
            self._stop.wait((time.monotonic() - started) * (1 / DUTY - 1))

    def _name(self, key: bytes, data: bytes) -> None:
        record = decode_record(data) if len(key) == KEY_BYTES else None
        blocks = None if record is None else record_blocks(
            record, ChunkKey(key), self._geometry, self._namespace, self._hashing)
        if blocks is None:
            self.unnamed += 1
            return
        self._found.append(Found(ChunkKey(key), blocks, False, remote=True))
        for gone in self._named.add(ChunkKey(key)):
            self._found.append(Found(gone, None, False, remote=True))

    def _check(self) -> None:
        """Ask the store about the chunks named longest ago: those it lost are gone."""
        self._checked = time.monotonic()
        keys = self._named.oldest(CHECK_KEYS)
        if not keys:
            return
        there = self._tier.exists(keys)
        if self._tier.down:
            return  # the round trip failed: nothing learnt
        for key, held in zip(keys, there, strict=True):
            if not held:
                self._named.discard(key)
                self._found.append(Found(key, None, False, remote=True))
