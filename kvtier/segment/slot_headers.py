"""Reading slot headers alone out of a segment, its own writer's or another's: 4 KiB each,
read only, through :class:`SafeDir` (no symlink followed, regular files of this user only).
What a header says is checked by its reader (``decode_header``): a slot being rewritten
meanwhile reads as damaged, never as another chunk's."""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvtier.io.format import HEADER_BYTES
from kvtier.io.safefs import read_at
from kvtier.segment.index_file import file_slots_for, open_segment_dir
from kvtier.segment.names import SLOT_FILE


def read_headers(root: str, namespace_id: str, writer: str, stride: int,
                 slots: Iterable[int]) -> dict[int, bytes]:
    """The header of each of ``slots`` (local slots, ``stride`` bytes apart) of ``writer``'s
    segment of namespace ``namespace_id`` on ``root``. A slot is missing from the answer
    when its segment or slot file cannot be opened safely, or ends before its header does."""
    found: dict[int, bytes] = {}
    try:
        directory = open_segment_dir(root, namespace_id, writer)
    except OSError:
        return found
    file_slots = file_slots_for(stride)
    fds: dict[int, int | None] = {}
    try:
        for slot in sorted(set(slots)):
            number, at = divmod(slot, file_slots)
            if number not in fds:
                try:
                    fds[number] = directory.open_file(SLOT_FILE.format(number), os.O_RDONLY)
                except OSError:
                    fds[number] = None
            fd = fds[number]
            if fd is None:
                continue
            try:
                data = read_at(fd, HEADER_BYTES, at * stride)
            except OSError:
                continue
            if len(data) == HEADER_BYTES:
                found[slot] = data
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        directory.close()
    return found
