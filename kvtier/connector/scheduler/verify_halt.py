"""When sampled checks keep finding wrong chunks, hits stop (``verify_halt_after``).

One wrong chunk is removed and the engine goes on. Several mean something is writing wrong
KV under right keys (a co-writer with another layout, a copy bug): every other chunk from
the same source is suspect, so the engine serves no more hits, computes every prompt, and
says so once. With a disk tier the halt is a file in the namespace's directory
(``kvtier.segment.halt_file``): every engine of the namespace on that directory stops
serving hits, a restart keeps the halt, and it ends, for all of them, when an operator has
looked at the cache and removed the file (``kvtier verify --repair``, ``kvtier clear``).
Without one it lasts until the engine restarts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvtier.io.answers import answer_wait, answers
from kvtier.io.guarded import start_thread
from kvtier.segment.halt_file import HaltFile

log = logging.getLogger("kvtier")
LOOK_EVERY_S = 5.0  # how often the halt file is looked for, off the scheduler's thread
HOW_TO_END = ("`kvtier verify --repair PATH` (or `kvtier clear PATH`) ends it once the cache "
              "is checked; look for a writer of another model, layout or version on it")


class VerifyHalt:
    """Counts mismatches; ``halted`` once ``limit`` of them were found (never with 0), or
    while the namespace's halt file (``marker``) exists."""

    def __init__(self, limit: int, counters: Counter, marker: HaltFile | None = None,
                 answer_timeout: float | None = 10.0) -> None:
        self.limit, self.counters, self.marker = limit, counters, marker
        self.mismatches = 0
        self.halted = False
        self._in_file = False  # the halt is the file's: it ends when the file goes
        self._writes = 0  # halt files this engine wrote (a look that raced one is dropped)
        self._unreadable = False  # the last look could not read the file (said once)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._answer_timeout = answer_timeout
        if marker is not None:  # a first look before any step, unless its path hangs
            first = threading.Event()
            if start_thread(threading.Thread(target=self._watch, args=(first,), name="kvtier-halt",
                                             daemon=True)):
                wait = answer_wait(answer_timeout)  # its path asked, then the file read
                first.wait(None if wait is None else 2 * wait)  # (a path hung: not waited for)
            elif answers(str(marker.root), answer_timeout):
                self.look()

    def mismatch(self) -> None:
        with self._lock:
            self.mismatches += 1
            if self.halted or not self.limit or self.mismatches < self.limit:
                return
            self._halt()
        log.error("kvtier: %d cached chunks held KV other than what vLLM computed for their "
                  "tokens (verify_halt_after=%d): no more hits are served, every prompt is "
                  "computed. %s", self.mismatches, self.limit,
                  f"The halt is {self.marker.path}: {HOW_TO_END}" if self.marker else
                  f"Until this engine restarts; first: {HOW_TO_END}")
        if self.marker is not None:  # on a thread: a hung filesystem must not stop a step
            start_thread(threading.Thread(target=self._write, args=(self.mismatches,),
                                          name="kvtier-halt-write", daemon=True))  # (or not at all)

    def _write(self, mismatches: int) -> None:
        assert self.marker is not None
        try:
            self.marker.write({"mismatches": mismatches, "limit": self.limit})
        except OSError as exc:
            log.warning("kvtier: the halt file %s could not be written (%s): the halt lasts "
                        "until this engine restarts", self.marker.path, exc)
            return
        with self._lock:
            self._in_file = self.halted
            self._writes += 1

    def _halt(self) -> None:
        self.halted = True
        self.counters["verify_halted"] = 1

    def look(self) -> None:
        """Follow the halt file: halt when one exists; go on when the file this halt was
        written to, or found in, is removed (a halt whose file could not be written lasts).
        Only a file gone (ENOENT) ends a halt: one that cannot be read now (EIO, ESTALE)
        keeps the state as it is, said once until a read succeeds. The file is read
        outside the lock; a write of it meanwhile (``_writes``) makes this look count for
        nothing, so a halt is never ended by a look older than its file."""
        assert self.marker is not None
        with self._lock:
            writes = self._writes
        try:
            there = self.marker.look() is not None
        except OSError as exc:
            if not self._unreadable:
                log.warning("kvtier: the halt file %s cannot be read (%s): hits stay as they "
                            "are until it can", self.marker.path, exc)
            self._unreadable = True
            return
        self._unreadable = False
        with self._lock:
            if writes != self._writes:
                return  # written since it was read: the next look sees it
            if there and not self.halted:
                self._halt()
                log.error("kvtier: %s says wrong KV was found in this namespace: no hits are "
                          "served. %s", self.marker.path, HOW_TO_END)
            if there:
                self._in_file = True
            elif self.halted and self._in_file:
                self._resume()

    def _resume(self) -> None:
        self.halted, self.mismatches, self._in_file = False, 0, False
        self.counters["verify_halted"] = 0
        log.warning("kvtier: %s was removed: hits are served again", self.marker.path
                    if self.marker else "the halt")

    def _watch(self, first: threading.Event) -> None:
        """Look now (the start waits for it: ``first``), then every ``LOOK_EVERY_S``."""
        assert self.marker is not None
        while True:
            try:  # a path that does not answer (a hung mount) is looked at once it does
                if answers(str(self.marker.root), self._answer_timeout):
                    self.look()
            except Exception as exc:  # a thread of its own: logged, never raised
                log.warning("kvtier: could not look for the halt file: %r", exc)
            first.set()
            if self._stop.wait(LOOK_EVERY_S):
                return

    def close(self) -> None:
        self._stop.set()
