"""The scheduler side's metrics (served on ``metrics_port``): a snapshot of its counters,
its tiers' indexes and the ``auto`` load policy's, taken on each scrape."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvtier.connector.scheduler.decider import LoadDecider
from kvtier.store.stats import shared_samples
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

if TYPE_CHECKING:
    from kvtier.connector.scheduler.payoff import Payoff
    from kvtier.connector.scheduler.remote_presence import RemotePresence
    from kvtier.metrics import Sample
    from kvtier.shared.follower import OtherWriters

_PLAIN = [  # (metric, help, counter)
    ("chunks_stored_total", "Chunks stored in host memory", "stored_chunks"),
    ("chunks_written_total", "Chunks written to disk", "disk_written_chunks"),
    ("store_failures_total", "Chunks that failed to store", "store_failed_chunks"),
    ("disk_write_failures_total", "Chunks that failed to reach disk", "disk_failed_chunks"),
    ("load_failures_total", "Chunks that failed to load (recomputed)", "load_failed_chunks"),
    ("store_no_room_chunks_total", "Chunks (prompt tails too) of finished requests never "
     "stored: no host slot was free at any of their steps, all held by writes to disk or the "
     "remote store and by loads in flight (host_capacity too small for the write rate)",
     "store_no_room_chunks"),
    ("load_cut_chunks_total", "Hits recomputed for want of a free host slot to stage them in "
     "(host_capacity too small for the loads running at once)", "load_cut_chunks"),
    ("room_waits_total", "Times a request was asked to come back next step while host slots "
     "to stage its hits in were in use", "room_waits"),
    ("remote_written_total", "Chunks written to the remote store (every rank's copy)",
     "remote_written_chunks"),
    ("remote_write_failures_total", "Chunks that failed to reach the remote store",
     "remote_failed_chunks"),
    ("remote_dropped_writes_total", "Remote writes dropped under back-pressure",
     "remote_dropped_chunks"),
    ("load_in_part_chunks_total", "Chunks read from disk in part: only the KV cache groups "
     "keeping blocks of them (a sliding window's hit)", "load_chunks_in_part"),
    ("load_out_of_window_chunks_total", "Chunks of hits that no KV cache group keeps a block "
     "of (out of every window): nothing read", "load_chunks_out_of_window"),
    ("remote_checked_total", "Chunks this engine wrote to the remote store asked about "
     "again, to find those it lost (a restart, an eviction)", "remote_audited_chunks"),
    ("remote_lost_total", "Chunks this engine wrote that the remote store no longer held "
     "when asked again (written again)", "remote_lost_chunks"),
    ("handoffs_waited_total", "Requests handed off by a prefill engine that waited for its "
     "chunks to show in the pool", "handoffs_waited"),
    ("handoffs_incomplete_total", "Handed-off requests whose chunks were not all in the pool "
     "after load_timeout (the rest recomputed)", "handoffs_incomplete"),
    ("handoff_tokens_recomputed_total", "Tokens of handed-off prompts recomputed for want of "
     "their chunks in the pool", "handoff_tokens_recomputed"),
    ("pool_rewritten_total", "Chunks a kv_producer wrote to the pool again after a write of "
     "them failed (disk or remote store)", "pool_rewritten_chunks"),
    ("pool_given_up_total", "Chunks whose failed write to the pool a kv_producer did not make "
     "again: tries spent, no disk slot in service, or no longer in host memory",
     "pool_given_up_chunks"),
    ("kv_events_total", "KV events of the host and disk tiers handed to vLLM's event stream",
     "kv_events"),
    ("chunks_verified_total", "Cached chunks compared with KV computed now (verify_sample)",
     "chunks_verified"),
    ("verify_sampled_total", "Requests that would have hit, computed instead to check their "
     "hits (verify_sample)", "verify_sampled_requests"),
    ("verify_unread_total", "Sampled chunks whose cached copy could not be read to check",
     "verify_unread_chunks"),
    ("verify_undecided_total", "Sampled chunks whose bytes differed in a KV cache format kvtier "
     "cannot decode: neither right nor wrong", "verify_undecided_chunks"),
    ("kv_events_dropped_total", "KV stored events dropped, the oldest first, while vLLM took "
     "none (more than 65,536 waiting; never a removal), and chunks named from token records "
     "dropped while waiting for the chunk before them (more than 65,536)", "kv_events_dropped"),
    ("kv_events_retold_total", "Chunks told again in KV events after vLLM's prefix cache was "
     "reset alone (its AllBlocksCleared makes a router forget kvtier's chunks too)",
     "kv_events_retold"),
    ("kv_events_unnamed_total", "Chunks on disk (at start, or in other engines' segments) "
     "and remote log entries not named in KV events: no token record naming their key",
     "kv_events_unnamed"),
]


def metric_samples(stack: TierStack, counters: Counter, decider: LoadDecider,
                   presence: RemotePresence | None = None,
                   others: OtherWriters | None = None,
                   payoff: Payoff | None = None) -> list[Sample]:
    """Samples of the tiers in ``stack``, of ``counters`` (``SchedulerSide.counters``), of
    ``decider``, of the remote store's lookups (``presence``, when there is one) and of the
    other engines' segments of a shared directory (``others``, when followed)."""
    from kvtier.metrics import Sample

    loaded = Sample("chunks_loaded_total", "counter", "Chunks loaded, by the tier they came from")
    evictions = Sample("evictions_total", "counter", "Chunks evicted, by tier")
    slots = Sample("slots", "gauge", "Chunk slots, by tier")
    used = Sample("used_slots", "gauge", "Chunk slots holding a chunk, by tier")
    for tier, index in stack.indexes.items():
        loaded.add(counters[f"load_chunks_{tier}"], tier=str(tier))
        evictions.add(index.evictions, tier=str(tier))
        slots.add(index.num_slots, tier=str(tier))
        used.add(len(index), tier=str(tier))
    extra: list[Sample] = []
    if others is not None:
        loaded.add(counters["load_chunks_shared"], tier="shared")
        seen = others.counts()
        extra += shared_samples(seen.chunks, seen.writers, seen.reclaimed, seen.seats_freed,
                                seen.distrusted)
    if presence is not None:
        loaded.add(counters["load_chunks_remote"], tier="remote")
        extra += presence_samples(presence)
    tiers = [*stack.indexes, *([TierName.SHARED] if others else []),
             *([TierName.REMOTE] if presence else [])]
    return [loaded, evictions, slots, used, *verify_samples(counters, tiers),
            *payoff_samples(payoff, tiers), *extra,
            *(Sample(name, "counter", text).add(counters[key]) for name, text, key in _PLAIN),
            Sample("loads_skipped_total", "counter", "Hits not loaded: recomputing was "
                   "faster (load_policy auto)").add(decider.skipped),
            Sample("drops_total", "counter", "Chunks evicted from the last tier").add(stack.drops)]


def presence_samples(presence: RemotePresence) -> list[Sample]:
    """The remote store's lookups and health, as the scheduler side sees them."""
    from kvtier.metrics import Sample

    return [Sample("remote_lookups_total", "counter", "Requests whose chunks were looked for in "
                   "the remote store").add(presence.lookups),
            Sample("remote_up", "gauge", "1 while the remote store is in service").add(
                int(not presence.out_of_service)),
            Sample("remote_nodes_out", "gauge", "Nodes of the remote store (a cluster's, a Mooncake "
                   "store's holders) out of service alone now: their chunks are misses").add(
                presence.nodes_out()),
            Sample("remote_records_passed_over_total", "counter", "Entries of the remote store's "
                   "log of token records passed over unread: far larger than kvtier's (another "
                   "client's)").add(presence.tiers[0].records_passed_over)]


def verify_samples(counters: Counter, tiers: list[TierName]) -> list[Sample]:
    """What sampled checks found (``VerifyPlanner``): wrong chunks by tier, and the halt."""
    from kvtier.metrics import Sample

    mismatches = Sample("verify_mismatches_total", "counter", "Chunks whose cached KV differed "
                        "from KV computed now, by the tier that would have served them (removed)")
    for tier in tiers:
        mismatches.add(counters[f"verify_mismatches_{tier}"], tier=str(tier))
    return [mismatches, Sample("verify_halted", "gauge", "1 once sampled checks found "
                               "verify_halt_after wrong chunks: no hits are served").add(
                                   counters["verify_halted"])]


def payoff_samples(payoff: Payoff | None, tiers: list[TierName]) -> list[Sample]:
    """Whether offload pays, by tier (``Payoff``): seconds loads took, seconds they saved."""
    from kvtier.metrics import Sample

    took = Sample("load_seconds_total", "counter", "Seconds loads took, by the coldest tier "
                  "each read from (the slowest rank's)")
    saved = Sample("seconds_saved_total", "counter", "Seconds of prefill loads saved (their "
                   "tokens at the measured prefill speed), by the coldest tier each read from")
    for tier in tiers:
        took.add(payoff.load_s.get(tier, 0.0) if payoff else 0.0, tier=str(tier))
        saved.add(payoff.saved_s.get(tier, 0.0) if payoff else 0.0, tier=str(tier))
    return [took, saved]
