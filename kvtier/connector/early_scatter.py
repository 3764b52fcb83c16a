"""Copying a load's chunks into the engine's pages as their disk reads land, not after the
last one: the copies of early chunks overlap the reads of later ones.

A chunk may be copied into the request's blocks from a read job's thread only while the load
is still in flight: once the engine's thread completes the load (every read over, or
``load_timeout`` up and the blocks handed back to vLLM to recompute), nothing may write into
them. The gate makes that exact: a copy runs under its lock and only while it is open;
``close`` takes the lock, so it returns after a copy in progress and before any later one.
The lock is held for one chunk's memcpy at most, never across I/O, so a hung drive cannot
hold ``close`` up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvtier")


class EarlyScatter:
    """The chunks of one in-flight load that were copied into its blocks by read jobs.

    Contract: ``land(key)`` (a read job's thread, after the chunk's read was verified)
    copies the chunk into its blocks with ``copy(key)`` if the load is still open, and
    records it; a copy that raises is logged and left to the engine's thread. ``close()``
    (the engine's thread, once) shuts the gate and returns the keys copied: the engine
    copies the others itself.
    """

    def __init__(self, copy: Callable[[bytes], None]) -> None:
        self._copy = copy
        self._lock = threading.Lock()
        self._open = True
        self._landed: set[bytes] = set()

    def land(self, key: bytes) -> None:
        with self._lock:
            if not self._open:
                return
            try:
                self._copy(key)
            except Exception:  # the engine's thread copies it again and reports what failed
                log.exception("kvtier: copying a chunk into its pages early failed")
                return
            self._landed.add(key)

    def close(self) -> set[bytes]:
        with self._lock:
            self._open = False
            return set(self._landed)
