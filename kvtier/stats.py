"""Counters of a store, and failures logged once per kind rather than once per chunk."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("kvtier")


@dataclass
class StoreStats:
    """Counters since the store was made. ``chunks_loaded`` counts by tier name."""

    chunks_stored: int = 0
    chunks_skipped: int = 0  # already cached, or no room
    chunks_loaded: Counter = field(default_factory=Counter)
    chunks_promoted: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: int = 0
    drops: int = 0  # victims that fell out of the last tier
    disk_writes: int = 0
    disk_write_bytes: int = 0
    disk_reads: int = 0
    disk_read_bytes: int = 0
    dropped_writes: int = 0  # write-through skipped under back-pressure
    corruptions: int = 0  # slots whose header or checksum did not check out
    io_errors: int = 0
    no_space: int = 0  # writes refused by the free-space floor or ENOSPC
    recovered_chunks: int = 0  # found on disk at start
    torn_slots: int = 0  # bad slots found at start
    paths_down: dict[str, str] = field(default_factory=dict)

    def snapshot(self) -> StoreStats:
        return copy.deepcopy(self)


class FailureLog:
    """Log the first failure of each kind at WARNING, the rest at DEBUG."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, kind: str, detail: str) -> None:
        if kind in self._seen:
            log.debug("kvtier %s: %s", kind, detail)
            return
        self._seen.add(kind)
        log.warning("kvtier %s: %s (further ones are counted, not logged)", kind, detail)
