"""A co-writer's segment made by hand for a reader to follow: its directory under
``writers/`` and a log naming whatever slots and entries a test wants (written as a writer
writes it, through ``SegmentLog``), with no slot files behind it."""

from __future__ import annotations

from kvtier.io.format import INDEX_ENTRY_BYTES, Codec, SlotHeader
from kvtier.io.safefs import SafeDir
from kvtier.keys import ChunkKey
from kvtier.segment.log import entries_of
from kvtier.segment.log_writer import SegmentLog
from kvtier.segment.names import WRITERS_DIR
from tests.helpers.disk_helpers import NS, RAW, key


def entry(n: int) -> bytes:
    """A valid index entry of chunk ``n`` (key ``key(n)``) of namespace ``NS``."""
    header = SlotHeader(NS.digest(), ChunkKey(key(n)), Codec.NONE, RAW, RAW, n + 1, n + 1, 0)
    return header.encode()[:INDEX_ENTRY_BYTES]


def segment(root, writer: str) -> SafeDir:
    """``writer``'s segment directory of ``NS`` under ``root``, made when missing."""
    with SafeDir.open(root) as top, top.subdir(NS.id, create=True) as ns_dir, \
            ns_dir.subdir(WRITERS_DIR, create=True) as writers:
        return writers.subdir(writer, create=True)


def write_log(root, writer: str, pairs: list[tuple[int, bytes]]) -> None:
    """Start ``writer``'s log afresh (a new file, a new epoch), naming ``pairs`` (local slot,
    entry), as a writer does at each restart."""
    with segment(root, writer) as directory:
        SegmentLog(directory, NS.digest(), lambda: entries_of(pairs), 1 << 40).close()
