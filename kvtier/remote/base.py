"""The contract of a remote tier: chunks in a distributed store shared by many machines."""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Collection, Sequence

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey

log = logging.getLogger("kvtier")


RECORD_LOG = 65536  # token records a store's log keeps, about (1.1 KiB each at 256 tokens)


class RemoteTier(abc.ABC):
    """Chunks of one namespace in a remote store.

    Contract:

    - ``exists(keys)``, ``get_many(keys, dsts)`` and ``put_many(items)`` each take a batch and
      cost one round trip to the store (pipelined); they block, so callers run them on I/O
      threads, never on a step of the engine. Thread-safe.
    - Results, never exceptions: ``get_many`` gives one ``IOResult`` per key: ``OK`` with the
      chunk's verified raw bytes in its ``dst`` (a writable buffer of ``raw_bytes``),
      ``MISSING`` (the store does not hold it: never put, or evicted), ``CORRUPT`` (a value
      that is truncated, damaged or another chunk's: ``dst`` may hold anything and must not
      be used), ``TIMED_OUT`` or ``IO_ERROR`` (the store is slow or down), ``PATH_DOWN``
      (the tier is out of service until its next retry).
    - Health: a failed round trip takes the tier out of service for ``retry_s``, then the
      next lookup or read tries again (its trial: ``_admit`` claims it; until it ends,
      within ``trial_s``, every other lookup and read finds the tier out, as before, rather
      than each wait on a store still hung; writes go on); ``down`` says whether a lookup
      or read would find it out now (for the trial's own thread: not). ``out_of_service``
      (and ``health``, the gauges') says whether it is out until a round trip works: from
      a failure until one works, a retry due or not. Going out of service is
      logged once (a warning), coming back once (info), the failed retries between at debug.
    - ``close()`` releases the connections; later calls answer ``PATH_DOWN``.
    - ``remove(keys)``: the values gone from the store (True once it answered).
    - ``append_records`` / ``read_records``: a log of the chunks' token records, where the
      backend keeps one (``keeps_records``), so that every engine of a fleet can name in its
      KV events the chunks the store holds.
    - ``get_parts(keys, dsts, wanted)``: as ``get_many``, for chunks in parts (a hybrid
      model's, ``parts``: each part's bytes), reading of each chunk only the parts
      ``wanted`` (indexes) into their places in its ``dst``, each checked; the rest of
      ``dst`` holds anything. ``OK`` carries the bytes read. A backend that cannot read part
      of a value reads it whole (the default).
    - Shape of a round trip: callers group reads into ``get_many`` calls of up to
      ``read_group_bytes`` and puts into ``put_many`` calls of up to ``put_group_bytes`` (one
      chunk at least). A store that serves parallel calls on parallel connections (Redis)
      wants groups small enough to spread over threads; one whose calls cost a fixed setup
      and share one transfer engine (Mooncake) wants them large.
    """

    read_group_bytes = 8 * 2**20
    put_group_bytes = 32 * 2**20
    trial_s = 30.0  # a trial's claim lapses after this (a backend sets its round trip's bound)

    def __init__(self, raw_bytes: int, retry_s: float, parts: Sequence[int] = ()) -> None:
        self.raw_bytes, self.retry_s, self.parts = raw_bytes, retry_s, tuple(parts)
        self._health = threading.Lock()
        self._down_until = 0.0
        self._trial: tuple[float, int] | None = None  # (until when, the thread) of a trial
        self._logged_down = False  # the warning of the outage now is out: retries at debug
        self._closed = False
        self.failures = 0  # round trips that failed

    @property
    def down(self) -> bool:
        now, trial = time.monotonic(), self._trial
        return self._closed or now < self._down_until or (
            trial is not None and now < trial[0] and trial[1] != threading.get_ident())

    @property
    def out_of_service(self) -> bool:
        return self._logged_down or self.down

    @abc.abstractmethod
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def exists_answered(self, keys: Sequence[ChunkKey]) -> list[bool | None] | None:
        """As ``exists``, where the store answered: None for a key it refused alone (a
        cluster's redirect while a slot moves), None for all when the round trip failed.
        What a check that reports a chunk gone needs: a refusal or a failure is no loss.
        The default: ``exists``, None when a round trip of this tier failed meanwhile."""
        failures = self.failures
        held = self.exists(keys)
        return None if self.failures != failures or self.down else list(held)

    @abc.abstractmethod
    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray]) -> list[IOResult]: ...

    def get_parts(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray],
                  wanted: Sequence[Collection[int]]) -> list[IOResult]:
        return self.get_many(keys, dsts)

    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[ChunkKey, np.ndarray]]) -> list[IOResult]: ...

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        """Remove ``keys``' values from the store (found wrong by a check against a fresh
        computation), one round trip: True once the store answered. A backend that cannot
        remove answers False (the default)."""
        return False

    keeps_records = False  # whether ``append_records`` and ``read_records`` do anything
    records_passed_over = 0  # entries of that log too large to be kvtier's, passed over unread

    def append_records(self, items: Sequence[tuple[ChunkKey, bytes]]) -> bool:
        """Append each chunk's token record (``kvtier.io.token_record``) to the store's log
        of them, which keeps about its last ``RECORD_LOG`` entries: one round trip, True
        once the store took them. A backend without such a log answers False (the
        default)."""
        return False

    def read_records(self, after: bytes, count: int) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
        """Up to ``count`` entries of that log after the entry named ``after`` (b"0": from
        its oldest), with the name of the last one read (``after`` when none): each (key,
        record) as the store holds it, unchecked (whoever can write the store can write
        these; an entry too large to be kvtier's, passed over unread, may read as (b"", b""),
        which names nothing). None when the round trip failed or the backend keeps no log (the
        default)."""
        return None

    def nodes_out(self) -> list[str]:
        """The nodes of the store out of service alone now (a cluster's, by address: their
        keys are misses while the others serve theirs); [] for a store that goes out of
        service as one (the default)."""
        return []

    def health(self) -> tuple[bool, int]:
        """Whether the store is out of service (``out_of_service``), and how many of its
        nodes are alone (``nodes_out``)."""
        return self.out_of_service, len(self.nodes_out())

    def register(self, memory: np.ndarray) -> None:
        """Memory that later gets and puts will use (a host tier's whole buffer, ``uint8``):
        a backend that moves bytes by DMA (an RDMA or TCP transfer engine) registers it once
        so that chunks move straight in and out of it; the default does nothing."""
        return None

    def close(self) -> None:
        self._closed = True

    # -- for backends --------------------------------------------------------------------

    def _unfit(self, dsts: Sequence[np.ndarray]) -> IOResult | None:
        """The ``IO_ERROR`` of a call given a ``dst`` this tier cannot read into (shorter
        than ``raw_bytes``, not contiguous, or read-only), or None when every one fits: a
        caller's mistake fails that call only, it never takes the tier out of service."""
        for dst in dsts:
            if dst.nbytes < self.raw_bytes or not dst.flags.c_contiguous or not dst.flags.writeable:
                return IOResult(IOStatus.IO_ERROR, 0, f"a buffer of {dst.nbytes} bytes (contiguous "
                                f"{dst.flags.c_contiguous}, writable {dst.flags.writeable}): this "
                                f"tier reads into writable contiguous buffers of {self.raw_bytes}")
        return None

    def _admit(self, claim: bool = True) -> bool:
        """Whether a round trip may go to the store now: in service, or out with its retry
        due and no trial under way, which this one claims. Without ``claim`` (a write, off
        any request's path, or a read of hints) it goes once the retry is due, another's
        trial or not, and claims none: a write held back would be lost."""
        if self._closed or time.monotonic() < self._down_until:
            return False
        if not claim or not self._logged_down:
            return True
        with self._health:
            now, trial = time.monotonic(), self._trial
            if now < self._down_until or (
                    trial is not None and now < trial[0] and trial[1] != threading.get_ident()):
                return False  # another's trial came first (it may have failed since)
            if self._logged_down:
                self._trial = (now + self.trial_s, threading.get_ident())
            return True

    def _no_news(self) -> None:
        """A round trip that asked the store nothing (every node of a cluster out): a trial
        this thread claimed is let go, for the next round trip to make."""
        with self._health:
            if self._trial is not None and self._trial[1] == threading.get_ident():
                self._trial = None

    def _failed(self, what: str, exc: BaseException) -> IOResult:
        """Note a failed round trip: out of service for ``retry_s`` (logged when it goes)."""
        with self._health:
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            self._trial = None
            first, self._logged_down = not self._logged_down, True
        if first:
            log.warning("kvtier: remote tier %s: %s failed (%s); out of service, tried again "
                        "every %g s", self.describe(), what, exc, self.retry_s)
        else:
            log.debug("kvtier: remote tier %s: %s failed again (%s)", self.describe(), what, exc)
        status = IOStatus.TIMED_OUT if isinstance(exc, TimeoutError) else IOStatus.IO_ERROR
        return IOResult(status, 0, f"{what}: {exc}")

    def _busy(self, what: str, exc: BaseException) -> IOResult:
        """Note a call that failed alone, the store not to blame (``CallsBusy``: every call
        thread busy with calls within the deadline): a failed round trip to
        ``exists_answered``, and the tier stays in service."""
        with self._health:
            self.failures += 1
        log.debug("kvtier: remote tier %s: %s failed (%s)", self.describe(), what, exc)
        return IOResult(IOStatus.TIMED_OUT, 0, f"{what}: {exc}")

    def _out_of_service(self) -> IOResult:
        return IOResult(IOStatus.PATH_DOWN, 0, f"remote tier {self.describe()} out of service")

    def _answered(self, failures: int) -> None:
        """A call went through with no failure of this tier's since it began (``failures``
        then): an outage logged is over (not on a port taking a connection alone: a paused
        server's kernel takes them)."""
        if self.failures == failures:
            self._succeeded()

    def _succeeded(self) -> None:
        """Note a round trip that worked: an outage logged is over (logged once)."""
        if not self._logged_down:
            return
        with self._health:
            was_down, self._logged_down, self._trial = self._logged_down, False, None
        if was_down:
            log.info("kvtier: remote tier %s is back in service", self.describe())

    @abc.abstractmethod
    def describe(self) -> str:
        """The store, as logs name it (never its credentials)."""
