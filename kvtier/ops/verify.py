"""``kvtier verify``: check every slot's header and payload; optionally free the bad ones."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.io.cachedir import INDEX_FILE
from kvtier.io.format import (
    HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    HeaderError,
    decode_header,
    is_blank,
    payload_checksum,
)
from kvtier.ops.cache import NamespaceDir, hold, index_entries


@dataclass
class VerifyReport:
    id: str
    slots: int = 0
    ok: int = 0
    free: int = 0
    corrupt: list[int] = field(default_factory=list)  # header fine, payload wrong or short
    torn: list[int] = field(default_factory=list)  # header does not check out
    foreign: list[int] = field(default_factory=list)  # another namespace's or size's slot
    unindexed: list[int] = field(default_factory=list)  # good slot the index does not name
    stale_index: list[int] = field(default_factory=list)  # index names a slot that is not there
    repaired: int = 0

    @property
    def problems(self) -> int:
        return (len(self.corrupt) + len(self.torn) + len(self.foreign) + len(self.unindexed)
                + len(self.stale_index))


def verify_namespace(directory: NamespaceDir, repair: bool = False,
                     progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Read every slot of ``directory``; with ``repair`` (the namespace must not be in use)
    blank bad slots and wrong index entries, and index good slots the index missed."""
    report = VerifyReport(directory.id)
    if not directory.meta:
        return report
    lock = hold(directory) if repair else -1
    try:
        indexed = {slot: header for slot, header in index_entries(directory)}
        digest = bytes.fromhex(directory.id)
        stride, file_slots = directory.stride, directory.file_slots
        fixes: list[tuple[int, bytes | None]] = []  # (slot, index entry to write or None=blank)
        seen: set[int] = set()
        for path in directory.slot_files:
            fd = os.open(path, os.O_RDWR if repair else os.O_RDONLY)
            try:
                for local in range(os.fstat(fd).st_size // stride):
                    slot = int(path.stem.split("-")[-1]) * file_slots + local
                    verdict, header_bytes = _check_slot(fd, local * stride, stride, digest,
                                                        directory.meta["raw_bytes"])
                    report.slots += 1
                    seen.add(slot)
                    _classify(report, slot, verdict, indexed, header_bytes, fixes)
                    if repair and verdict in ("corrupt", "torn", "foreign"):
                        os.pwrite(fd, bytes(HEADER_BYTES), local * stride)
                    if progress:
                        progress(1)
            finally:
                os.close(fd)
        for slot in indexed:
            if slot not in seen:  # the index names a slot past the end of the files
                report.stale_index.append(slot)
                fixes.append((slot, None))
        if repair:
            report.repaired = _rewrite_index(directory, fixes)
    finally:
        if lock >= 0:
            os.close(lock)
    return report


def _check_slot(fd: int, offset: int, stride: int, digest: bytes, raw_bytes: int) -> tuple[str, bytes]:
    data = os.pread(fd, stride, offset)
    header_bytes = data[:INDEX_ENTRY_BYTES]
    if len(data) < HEADER_BYTES or is_blank(data):
        return "free", header_bytes
    try:
        header = decode_header(data[:HEADER_BYTES])
    except HeaderError:
        return "torn", header_bytes
    if header.namespace != digest or header.raw_bytes != raw_bytes:
        return "foreign", header_bytes
    payload = data[HEADER_BYTES:HEADER_BYTES + header.payload_bytes]
    if len(payload) < header.payload_bytes or payload_checksum(payload) != header.payload_checksum:
        return "corrupt", header_bytes
    return "ok", header_bytes


def _classify(report: VerifyReport, slot: int, verdict: str, indexed: dict,
              header_bytes: bytes, fixes: list) -> None:
    if verdict == "free":
        report.free += 1
    elif verdict == "ok":
        report.ok += 1
        if slot not in indexed or indexed[slot] is None:
            report.unindexed.append(slot)
            fixes.append((slot, header_bytes))
        return
    else:
        getattr(report, verdict).append(slot)
    if slot in indexed:  # the index names a slot that holds nothing good
        if verdict == "free":
            report.stale_index.append(slot)
        fixes.append((slot, None))


def _rewrite_index(directory: NamespaceDir, fixes: list[tuple[int, bytes | None]]) -> int:
    fd = os.open(directory.path / INDEX_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        for slot, entry in fixes:
            os.pwrite(fd, entry if entry is not None else bytes(INDEX_ENTRY_BYTES),
                      slot * INDEX_ENTRY_BYTES)
    finally:
        os.close(fd)
    return len(fixes)
