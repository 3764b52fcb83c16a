"""What a reader keeps of the other writers it follows: each followed segment, each chunk
found in one, each writer as seen, and how many writers one reader may follow."""

from __future__ import annotations

import itertools
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.io.safefs import SafeDir
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import MAX_SLOTS, SlotLayout
from kvtier.segment.lease import LeaseInfo
from kvtier.segment.log import LogFollower
from kvtier.shared.chunk_index import Copy
from kvtier.shared.reads import SlotRef

log = logging.getLogger("kvtier")
MAX_WRITERS = 4096  # writer segments followed per namespace and path; more are not looked at
FILES_PER_WRITER = 2  # a followed segment keeps its directory and its log open
FILE_SHARE = 4  # of the process's open-file limit, at most a quarter goes to followed segments


def followable_writers(paths: int) -> int:
    """Writer segments one view follows per path: ``MAX_WRITERS``, or fewer when the
    process's open-file limit (``RLIMIT_NOFILE``, soft) would not leave three quarters of it
    to the rest of the process (an engine's sockets and files)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_WRITERS
    return max(1, min(MAX_WRITERS, soft // (FILE_SHARE * FILES_PER_WRITER * max(1, paths))))


def say_passed_over(max_slots: int) -> None:
    """Said once a view passed over slots past ``max_slots`` (``SharedView.passed_over``)."""
    log.warning("kvtier: other writers' logs name more chunks than the shared directory holds "
                "(%d slots a path, by disk_capacity); the rest are not followed (misses). Give "
                "every engine on the directory the same disk_capacity, or look for files kvtier "
                "did not write (kvtier verify)", max_slots)


def directory_slots(raw_bytes: int, paths: int, disk_capacity: int) -> int:
    """The chunk slots a namespace's whole directory holds on one of its ``paths`` paths
    (``disk_capacity`` bytes over every writer): no writer of it holds more."""
    return min(MAX_SLOTS, SlotLayout(raw_bytes, max(1, paths), disk_capacity).per_path)


@dataclass(frozen=True)
class OtherChunk:
    """A chunk in another writer's segment: local ``slot`` of its files on path ``path``,
    and what that writer's log says of it (key, codec, payload length)."""

    writer: str
    path: int
    slot: int
    key: ChunkKey
    codec: int
    payload_bytes: int

    def ref(self, generation: int) -> SlotRef:
        return SlotRef(self.writer, self.path, self.slot, self.key, self.codec,
                       self.payload_bytes, generation)


@dataclass(frozen=True)
class WriterState:
    """One other writer as this reader sees it."""

    writer: str
    live: bool
    chunks: int
    lease: LeaseInfo | None


# A process's writer id on each disk path: the segments there it skips as its own; None where
# it holds none (every writer there is another)
OwnSegments = tuple[str | None, ...]
_GENERATIONS = itertools.count(1)  # never the same twice: readers' cached files go stale
_SOURCES = itertools.count()  # each segment followed gets a number of its own


class Followed:
    """Writer ``writer``'s segment on path ``path``, followed (the directory with inode
    ``inode``); ``source`` numbers it among every segment this process followed."""

    def __init__(self, path: int, writer: str, directory: SafeDir, namespace: bytes,
                 raw_bytes: int, max_slots: int) -> None:
        self.path, self.writer, self.source = path, writer, next(_SOURCES)
        self.dir = directory
        self.inode = directory.inode()
        self.follower = LogFollower(directory, namespace, raw_bytes, max_slots)
        self.lease: LeaseInfo | None = None
        self.generation = next(_GENERATIONS)  # new at each reset: readers reopen its files

    def renew(self) -> None:
        """The writer's log started afresh: readers reopen its files."""
        self.generation = next(_GENERATIONS)

    def close(self) -> None:
        self.follower.close()
        self.dir.close()


def writer_states(followed: dict[tuple[int, str], Followed],
                  live: Callable[[int, str], bool]) -> list[WriterState]:
    """One ``WriterState`` a writer of the segments ``followed`` (by path and writer), its
    chunks summed over its paths, live when ``live(path, writer)`` is on any of them."""
    chunks: dict[str, int] = {}
    leases: dict[str, LeaseInfo | None] = {}
    lives: dict[str, bool] = {}
    for (path, writer), segment in followed.items():
        chunks[writer] = chunks.get(writer, 0) + len(segment.follower.slots)
        leases[writer] = leases.get(writer) or segment.lease
        lives[writer] = lives.get(writer, False) or live(path, writer)
    return [WriterState(w, lives[w], chunks[w], leases[w]) for w in sorted(chunks)]


def chunk_of(sources: dict[int, Followed], key: ChunkKey, copy: Copy) -> OtherChunk | None:
    """``copy`` of ``key`` as the chunk of the segment it is in (``sources``, by number);
    None when that segment is no longer followed."""
    by = sources.get(copy.source)  # the segment followed
    if by is None:
        return None
    return OtherChunk(by.writer, by.path, copy.slot, key, copy.codec, copy.payload_bytes)
