"""The scheduler side's disk tier at start: its slots, and the chunks its ranks left there."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.geometry import KVGeometry
from kvtier.keys import Namespace
from kvtier.segment.index_file import SlotLayout, read_disk_index
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

log = logging.getLogger("kvtier")


def disk_layout(config: KVTierConfig, geometry: KVGeometry) -> SlotLayout | None:
    """The disk tier's slots, or None without disk paths."""
    if not config.disk_paths:
        return None
    layout = SlotLayout(geometry.chunk_bytes, len(config.disk_paths), config.segment_capacity)
    layout.check_bounded()
    return layout


def recover_disk(config: KVTierConfig, namespaces: Sequence[Namespace], writers: Sequence[object],
                 layout: SlotLayout | None, stack: TierStack) -> int:
    """Adopt the chunks every rank (``namespaces``, each rank's writer id) has on disk, in
    the same slot, oldest first; the number adopted (none without a disk tier, or when a
    rank's writer id is not known)."""
    if layout is None:
        return 0
    if None in writers:
        log.warning("kvtier: the writer id of this engine's workers is not known (set "
                    "instance_id): chunks on disk from before this start are not used")
        return 0
    per_rank = [read_disk_index(list(config.disk_paths), ns, layout, str(writer), config.load_timeout)
                for ns, writer in zip(namespaces, writers, strict=True)]
    common = [(key, slot, header) for key, (slot, header) in per_rank[0].items()
              if all(other.get(key, (None,))[0] == slot for other in per_rank[1:])]
    index = stack.indexes[TierName.DISK]
    for key, slot, _ in sorted(common, key=lambda item: item[2].generation):
        index.adopt(key, slot)
    log.info("kvtier: %d chunks found on disk", len(index))
    return len(index)
