"""Counters of a store, and the metric samples made of them."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.shared.follower import FollowedCounts

log = logging.getLogger("kvtier")


@dataclass
class StoreStats:
    """Counters since the store was made. ``chunks_loaded`` counts by tier name."""

    chunks_stored: int = 0
    chunks_skipped: int = 0  # already cached, no room, or past what the largest tier holds
    chunks_loaded: Counter = field(default_factory=Counter)
    chunks_missed: int = 0  # full chunks asked for by get() and not loaded
    chunks_promoted: int = 0  # moved up a tier by get(): disk to host, to the device pool
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
    load_timeouts: int = 0  # disk reads (and write-back moves) given up on after load_timeout
    no_space: int = 0  # writes refused by the free-space floor or ENOSPC
    recovered_chunks: int = 0  # found on disk at start (or on a path back, out since then)
    torn_slots: int = 0  # bad slots found at start
    paths_down: dict[str, str] = field(default_factory=dict)
    paths_back: int = 0  # times a path out of service was tried again and came back
    shared_reads: int = 0  # chunks read from other writers' segments (a shared directory)
    shared_read_bytes: int = 0
    shared_failures: int = 0  # such reads that failed their check (a writer racing us) or I/O
    shared_chunks: int = 0  # chunks other writers hold, as last seen
    shared_writers: int = 0  # other writers seen, live or not
    shared_reclaimed: int = 0  # segments of writers gone that this store reclaimed
    shared_seats_freed: int = 0  # seats naming no writer that this store gave back
    shared_writers_distrusted: int = 0  # times a writer whose copies proved bad was passed over
    remote_reads: int = 0  # chunks read from the remote store (remote_url)
    remote_read_bytes: int = 0
    remote_writes: int = 0  # chunks written to it
    remote_write_bytes: int = 0
    remote_lookups: int = 0  # round trips asking which chunks it holds
    remote_misses: int = 0  # chunks it said it held and then did not have (evicted)
    remote_failures: int = 0  # lookups, reads and writes that failed: corrupt, timed out, down, full
    remote_dropped_writes: int = 0  # writes skipped under back-pressure
    remote_down: bool = False  # out of service now (after a failed round trip)
    remote_nodes_out: int = 0  # a cluster's nodes out of service alone now
    chunks_verified: int = 0  # compared with KV computed now (verify_against)
    verify_mismatches: Counter = field(default_factory=Counter)  # found wrong, by tier

    def take_followed(self, seen: FollowedCounts) -> None:
        """What the follower of the shared directory sees now."""
        self.shared_chunks, self.shared_writers = seen.chunks, seen.writers
        self.shared_reclaimed, self.shared_seats_freed = seen.reclaimed, seen.seats_freed
        self.shared_writers_distrusted = seen.distrusted

    def snapshot(self) -> StoreStats:
        return copy.deepcopy(self)


def store_samples(stats: StoreStats, slots: dict[str, int], used: dict[str, int],
                  queue_depth: int, remote: tuple[str, int] | None = None,
                  shared: bool = False) -> list:
    """Metric samples of a store: its counters, its tiers' capacity and fill, its I/O queue,
    with ``remote`` (its backend, its writes queued) the remote tier's, and with ``shared``
    (other writers' segments are followed) the shared directory's."""
    from kvtier.metrics import Sample

    loaded = Sample("chunks_loaded_total", "counter", "Chunks loaded, by the tier they came from")
    for tier, count in stats.chunks_loaded.items():
        loaded.add(count, tier=str(tier))
    if shared and "shared" not in stats.chunks_loaded:  # a series from the start, at 0
        loaded.add(0, tier="shared")
    mismatches = Sample("verify_mismatches_total", "counter", "Chunks whose cached KV differed "
                        "from KV computed now, by the tier that would have served them (removed)")
    counts = {str(tier): count for tier, count in stats.verify_mismatches.items()}
    for tier in dict.fromkeys([*slots, *counts]):  # a series from the start for each tier
        mismatches.add(counts.get(tier, 0), tier=tier)
    verified = Sample("chunks_verified_total", "counter", "Cached chunks compared with KV "
                      "computed now").add(stats.chunks_verified)
    samples = [loaded, *_tier_samples(stats, slots, used), *_disk_samples(stats),
               *_plain_samples(stats, queue_depth), verified, mismatches]
    if shared:
        samples += _shared_store_samples(stats)
    return samples + (remote_samples(stats, *remote) if remote is not None else [])


def _tier_samples(stats: StoreStats, slots: dict[str, int], used: dict[str, int]) -> list:
    """Evictions, slots and slots in use, by tier."""
    from kvtier.metrics import Sample

    evictions = Sample("evictions_total", "counter", "Chunks evicted, by tier")
    for tier, count in stats.evictions.items():
        evictions.add(count, tier=tier)
    capacity = Sample("slots", "gauge", "Chunk slots, by tier")
    fill = Sample("used_slots", "gauge", "Chunk slots holding a chunk, by tier")
    for tier in slots:
        capacity.add(slots[tier], tier=tier)
        fill.add(used[tier], tier=tier)
    return [evictions, capacity, fill]


def _disk_samples(stats: StoreStats) -> list:
    """Bytes and chunks moved to and from disk."""
    from kvtier.metrics import Sample

    disk_bytes = Sample("disk_bytes_total", "counter", "Bytes moved to and from disk "
                        "(write: for SSD wear accounting)")
    disk_bytes.add(stats.disk_read_bytes, direction="read").add(stats.disk_write_bytes, direction="write")
    disk_ops = Sample("disk_chunks_total", "counter", "Chunks read from and written to disk")
    disk_ops.add(stats.disk_reads, direction="read").add(stats.disk_writes, direction="write")
    return [disk_bytes, disk_ops]


def _plain_samples(stats: StoreStats, queue_depth: int) -> list:
    """The samples of one series each: the store's other counters, its I/O queue and its
    disk paths out of service."""
    from kvtier.metrics import Sample

    plain = [("chunks_stored_total", "counter", "Chunks stored", stats.chunks_stored),
             ("chunks_missed_total", "counter", "Chunks asked for and not cached", stats.chunks_missed),
             ("chunks_promoted_total", "counter", "Chunks copied to a hotter tier", stats.chunks_promoted),
             ("demotions_total", "counter", "Chunks moved down a tier", stats.demotions),
             ("drops_total", "counter", "Chunks evicted from the last tier", stats.drops),
             ("corruptions_total", "counter", "Slots that failed their checks", stats.corruptions),
             ("io_errors_total", "counter", "Disk requests that failed with an I/O error", stats.io_errors),
             ("load_timeouts_total", "counter",
              "Disk reads (and write-back moves) given up on after load_timeout", stats.load_timeouts),
             ("no_space_total", "counter", "Disk writes refused for space", stats.no_space),
             ("dropped_writes_total", "counter", "Write-through writes dropped under back-pressure",
              stats.dropped_writes),
             ("io_queue_depth", "gauge", "Disk requests queued or running", queue_depth),
             ("paths_down", "gauge", "Disk paths out of service", len(stats.paths_down)),
             ("paths_back_total", "counter", "Disk paths that came back into service", stats.paths_back)]
    return [Sample(name, kind, text).add(value) for name, kind, text, value in plain]


def _shared_store_samples(stats: StoreStats) -> list:
    """The shared directory's metrics of a store that follows other writers' segments."""
    from kvtier.metrics import Sample

    return [*shared_samples(stats.shared_chunks, stats.shared_writers, stats.shared_reclaimed,
                            stats.shared_seats_freed, stats.shared_writers_distrusted),
            Sample("shared_read_bytes_total", "counter", "Bytes read from other "
                   "writers' segments").add(stats.shared_read_bytes),
            Sample("shared_failures_total", "counter", "Reads of other writers' chunks "
                   "that failed their check or their I/O").add(stats.shared_failures)]


def shared_samples(chunks: int, writers: int, reclaimed: int, seats_freed: int,
                   distrusted: int) -> list:
    """The shared directory's metrics, for a store and for an engine's scheduler side."""
    from kvtier.metrics import Sample

    return [Sample("shared_chunks", "gauge", "Chunks other writers hold, as last seen").add(chunks),
            Sample("shared_writers", "gauge", "Other writers seen, live or not").add(writers),
            Sample("shared_reclaimed_total", "counter", "Segments of writers gone that this "
                   "one reclaimed").add(reclaimed),
            Sample("shared_seats_freed_total", "counter", "Seats naming no writer that this "
                   "one gave back").add(seats_freed),
            Sample("shared_writers_distrusted_total", "counter", "Times a writer whose copies "
                   "read lately mostly proved bad was passed over").add(distrusted)]


def remote_samples(stats: StoreStats, backend: str, queued: int) -> list:
    """The remote tier's metrics, labelled with its backend (``redis``, ``mooncake``)."""
    from kvtier.metrics import Sample

    moved = Sample("remote_bytes_total", "counter", "Bytes read from and written to the remote store")
    moved.add(stats.remote_read_bytes, backend=backend, direction="read")
    moved.add(stats.remote_write_bytes, backend=backend, direction="write")
    chunks = Sample("remote_chunks_total", "counter", "Chunks read from and written to the remote store")
    chunks.add(stats.remote_reads, backend=backend, direction="read")
    chunks.add(stats.remote_writes, backend=backend, direction="write")
    plain = [("remote_lookups_total", "counter", "Round trips asking the remote store which chunks "
              "it holds", stats.remote_lookups),
             ("remote_misses_total", "counter", "Chunks the remote store said it held and no "
              "longer had (evicted)", stats.remote_misses),
             ("remote_failures_total", "counter", "Remote lookups, reads and writes that failed "
              "(corrupt, timed out, store down or full)", stats.remote_failures),
             ("remote_dropped_writes_total", "counter", "Remote writes dropped under "
              "back-pressure", stats.remote_dropped_writes),
             ("remote_queue_depth", "gauge", "Remote writes queued or running", queued),
             ("remote_up", "gauge", "1 while the remote store is in service", int(not stats.remote_down)),
             ("remote_nodes_out", "gauge", "Nodes of the remote store (a cluster's) out of service "
              "alone now: their chunks are misses", stats.remote_nodes_out)]
    return [moved, chunks, *(Sample(name, kind, text).add(value, backend=backend)
                             for name, kind, text, value in plain)]
