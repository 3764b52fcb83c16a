"""Reading what the disk tier holds from its index files and slot headers, without I/O
threads or locks: shared by the disk tier at start-up and by the vLLM scheduler side."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.io.answers import answers, ask
from kvtier.io.bounded_jobs import path_job_wait
from kvtier.io.format import (
    HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    MAGIC,
    HeaderError,
    SlotHeader,
    decode_header,
    is_blank,
)
from kvtier.io.root_looks import look_at_roots
from kvtier.io.safefs import SafeDir, read_at
from kvtier.io.vectored import RUN_BYTES
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.names import INDEX_FILE, WRITERS_DIR

FILE_BYTES = 8 * 1024**3  # a slot file holds at most this much (whole slots)
MAX_SLOTS = 1 << 24  # slots per namespace: bookkeeping costs ~30 bytes of memory each
MAX_RAW_BYTES = 1 << 30  # the largest chunk kvtier stores


@dataclass(frozen=True)
class SlotLayout:
    """Where the disk tier's slots are: ``per_path`` slots on each of ``num_paths`` paths,
    slot ``s`` on path ``s % num_paths``, ``stride`` bytes each, ``raw_bytes`` of payload."""

    raw_bytes: int
    num_paths: int
    capacity: int

    @property
    def stride(self) -> int:
        return HEADER_BYTES + -(-self.raw_bytes // 4096) * 4096

    @property
    def per_path(self) -> int:
        return (self.capacity // self.num_paths) // self.stride

    @property
    def num_slots(self) -> int:
        return self.per_path * self.num_paths

    @property
    def file_slots(self) -> int:
        """Slots per slot file (fixed for a stride: slots never move)."""
        return file_slots_for(self.stride)

    def runs(self, slots: list[int], max_run: int) -> list[list[int]]:
        """Indexes of ``slots`` grouped into runs of neighbours in one slot file (sorted),
        at most ``max_run`` each and ``RUN_BYTES`` in all: each run moves in one vectored
        call."""
        max_run = max(1, min(max_run, RUN_BYTES // self.stride))
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        paths, file_slots = self.num_paths, self.file_slots
        runs: list[list[int]] = []
        for i in order:
            last = runs[-1] if runs else None
            if (last is not None and len(last) < max_run
                    and slots[i] == slots[last[-1]] + paths
                    and (slots[i] // paths) // file_slots == (slots[last[-1]] // paths) // file_slots):
                last.append(i)
            else:
                runs.append([i])
        return runs

    def check_bounded(self) -> None:
        """Raise ``ConfigError`` when the disk tier would need more slots (or a larger chunk)
        than kvtier keeps bookkeeping for."""
        if self.raw_bytes > MAX_RAW_BYTES:
            raise ConfigError(f"kvtier config: a chunk of {self.raw_bytes} bytes is larger than "
                              f"the {MAX_RAW_BYTES} kvtier stores; lower chunk_tokens")
        if self.per_path == 0:
            raise ConfigError(
                f"kvtier config: a writer's share of disk_capacity (disk_capacity / "
                f"share_writers = {self.capacity} bytes, over {self.num_paths} disk paths) holds "
                f"no chunk slot of {self.stride} bytes on a path; raise disk_capacity, or lower "
                "share_writers or chunk_tokens")
        if self.num_slots > MAX_SLOTS:
            raise ConfigError(
                f"kvtier config: disk_capacity={self.capacity} holds {self.num_slots} chunks of "
                f"{self.stride} bytes, more than the {MAX_SLOTS} slots kvtier keeps track of; "
                "raise chunk_tokens or lower disk_capacity")


def file_slots_for(stride: int) -> int:
    return max(1, FILE_BYTES // stride)


MAX_GENERATION = 1 << 63  # generations are times in ns (year 2262); from here on: damage


def valid_header(data, namespace_digest: bytes, layout: SlotLayout) -> SlotHeader | None:
    """The header in ``data`` if it checks out and belongs to this namespace and size, with
    a generation below ``MAX_GENERATION`` (one near 2**64 would win every comparison and
    leave a restarted writer no generation to give its next write)."""
    try:
        header = decode_header(data)
    except HeaderError:
        return None
    if (header.namespace != namespace_digest or header.raw_bytes != layout.raw_bytes
            or header.payload_bytes > layout.stride - HEADER_BYTES
            or header.generation >= MAX_GENERATION):
        return None
    return header


def parse_index(entries: bytes, namespace_digest: bytes, layout: SlotLayout,
                path_index: int) -> tuple[list[tuple[int, SlotHeader]], int]:
    """(valid (slot, header) pairs, bad entries) in one path's index file contents."""
    found, bad = [], 0
    count = min(len(entries) // INDEX_ENTRY_BYTES, layout.per_path)
    for local in range(count):
        entry = entries[local * INDEX_ENTRY_BYTES:(local + 1) * INDEX_ENTRY_BYTES]
        if is_blank(entry):
            continue
        header = valid_header(entry, namespace_digest, layout)
        if header is None:
            bad += 1
        else:
            found.append((local * layout.num_paths + path_index, header))
    return found, bad


Found = tuple[int, SlotHeader]  # (slot, its header)


def newest_per_key(found: Iterable[Found]) -> tuple[dict[ChunkKey, Found], int]:
    """The newest slot of every key, and how many older copies lost."""
    best: dict[ChunkKey, tuple[int, SlotHeader]] = {}
    duplicates = 0
    for slot, header in found:
        previous = best.get(header.key)
        if previous is not None:
            duplicates += 1
            if previous[1].generation > header.generation:
                continue
        best[header.key] = (slot, header)
    return best, duplicates


INDEX_PIECE_ENTRIES = 8192  # entries read at a time by ``written_index_entries``: 1 MiB


def written_index_entries(directory: SafeDir, slots: int,
                          magic: bytes = MAGIC) -> Generator[tuple[int, bytes], None, None]:
    """(slot, entry) for each entry of the first ``slots`` of a namespace's index file that
    is not blank (or, with ``magic`` ``REMOVED``, each tombstone: ``mark_removed``), read a
    MiB at a time (so a huge or sparse index is never held whole, and a MiB holding no
    entry costs one search); none when the file is missing."""
    try:
        fd = directory.open_file(INDEX_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        end = min(os.fstat(fd).st_size // INDEX_ENTRY_BYTES, slots)
        for first in range(0, end, INDEX_PIECE_ENTRIES):
            wanted = min(INDEX_PIECE_ENTRIES, end - first) * INDEX_ENTRY_BYTES
            data = read_at(fd, wanted, first * INDEX_ENTRY_BYTES)
            if magic in data:
                for j in range(len(data) // INDEX_ENTRY_BYTES):
                    entry = data[j * INDEX_ENTRY_BYTES:(j + 1) * INDEX_ENTRY_BYTES]
                    if entry[:len(magic)] == magic:
                        yield first + j, entry
            if len(data) < wanted:  # the file shrank meanwhile
                return
    finally:
        os.close(fd)


def open_segment_dir(root: str, namespace_id: str, writer: str) -> SafeDir:
    """``writer``'s segment of namespace ``namespace_id`` under ``root``, read only (nothing
    is made); ``OSError`` when it is missing or unsafe."""
    with SafeDir.open(root) as top, top.subdir(namespace_id) as ns_dir, \
            ns_dir.subdir(WRITERS_DIR) as writers:
        return writers.subdir(writer)


def read_disk_index(roots: list[str], namespace: Namespace, layout: SlotLayout, writer: str,
                    answer_timeout: float | None = None) -> dict[ChunkKey, tuple[int, SlotHeader]]:
    """What ``writer``'s segments of a namespace hold on ``roots``, from the index files
    alone (missing, unsafe or unreadable paths hold nothing, nor, with ``answer_timeout``,
    one whose file system does not answer within it, or whose read is not over within
    ``path_job_wait`` of it: a hung mount, or one with a read of an index still under way
    from an earlier call, another rank's say: ``look_at_roots``). Reads only: the process
    that writes holds the lock."""
    ask(roots, answer_timeout)  # every path at once: hung ones cost one wait, not one each
    index_of = {root: index for index, root in enumerate(roots)}
    answering = [root for root in roots if answer_timeout is None or answers(root, answer_timeout)]
    read = look_at_roots(answering, lambda root: _index_entries(
        root, namespace, layout, writer, index_of[root]), path_job_wait(answer_timeout),
        "kvtier-index-read")
    return newest_per_key([f for part in read.values() if isinstance(part, list) for f in part])[0]


def _index_entries(root: str, namespace: Namespace, layout: SlotLayout, writer: str,
                   index: int) -> list[tuple[int, SlotHeader]]:
    """(slot, header) of each valid entry of ``writer``'s index on path ``index``
    (``root``); an error ends the list (each entry found before it was checked)."""
    found: list[tuple[int, SlotHeader]] = []
    digest = namespace.digest()
    try:
        with open_segment_dir(root, namespace.id, writer) as directory:
            for local, entry in written_index_entries(directory, layout.per_path):
                header = valid_header(entry, digest, layout)
                if header is not None:
                    found.append((local * layout.num_paths + index, header))
    except OSError:
        pass
    return found
