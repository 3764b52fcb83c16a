"""Reading a segment's slot files offline, as ``kvtier verify`` judges each slot: through a
descriptor ``SafeDir`` opened (a regular file of this user, no symlink followed), each read
at most one slot, and holes (slots freed by ``gc``, or never written) skipped unread.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

from kvtier.io.format import (
    HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    HeaderError,
    decode_header,
    is_blank,
    payload_matches,
)
from kvtier.io.safefs import CacheDirError, SafeDir, read_at
from kvtier.ops.cache import NamespaceMeta
from kvtier.segment.index_file import MAX_GENERATION

Look = tuple[str, bytes]  # (verdict, the slot's first INDEX_ENTRY_BYTES; b"" when free)


def open_slot_file(directory: SafeDir, name: str, flags: int) -> int:
    """``directory.open_file``; a slot file gone since it was listed is an ``OSError`` that
    says so (the segment's problem), never a reason to stop."""
    try:
        return directory.open_file(name, flags)
    except FileNotFoundError:
        raise CacheDirError(errno.ENOENT, f"{directory.path}/{name} went away while verify read "
                            "the segment (its writer trimmed its files, or gc or clear ran): "
                            "run verify again") from None


def slots_of_file(fd: int, count: int, meta: NamespaceMeta,
                  digest: bytes) -> Iterator[tuple[int | range, Look]]:
    """(slot in file, ``look``) for slots ``0..count``; the slots in a hole of a sparse file
    come as one range, free, and are not read."""
    stride = meta.stride
    local = 0
    while local < count:
        start = next_data(fd, local * stride)
        first = count if start is None else min(count, start // stride)
        if first > local:
            yield range(local, first), ("free", b"")
        if first >= count:
            return
        yield first, look(read_at(fd, stride, first * stride), digest, meta.raw_bytes)
        local = first + 1


def next_data(fd: int, offset: int) -> int | None:
    """The offset of the next byte of data at or after ``offset``; None when only a hole
    follows. Filesystems without SEEK_DATA report all of a file as data."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        return offset


def look(data: bytes, digest: bytes, raw_bytes: int) -> Look:
    """What a slot of namespace ``digest`` holding ``data`` (its bytes, up to one stride) is:
    its verdict (``verdict``) and, unless free, the first bytes of its header, as its index
    entry keeps them."""
    found = verdict(data, digest, raw_bytes)
    return found, b"" if found == "free" else data[:INDEX_ENTRY_BYTES]


def verdict(data: bytes, digest: bytes, raw_bytes: int) -> str:
    """free | torn (no checked header, or one whose generation no engine accepts) | foreign
    (another namespace's) | mismatched (this namespace's, for another chunk size) | corrupt
    (its payload fails its checksum, or is short) | ok."""
    if len(data) < HEADER_BYTES or is_blank(data):
        return "free"
    try:
        header = decode_header(data[:HEADER_BYTES])
    except HeaderError:
        return "torn"
    if header.generation >= MAX_GENERATION:  # as the engines' reader (``valid_header``)
        return "torn"
    if header.namespace != digest:
        return "foreign"
    if header.raw_bytes != raw_bytes:
        return "mismatched"
    payload = data[HEADER_BYTES:HEADER_BYTES + header.payload_bytes]
    if not payload_matches(header, payload):  # its checksum, or every part's
        return "corrupt"
    return "ok"
