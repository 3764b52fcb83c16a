"""Rebuilding what a disk tier holds at start-up: from the index files, or by reading every
slot header where an index is missing. A part of ``DiskTier``, kept in its own file."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, SlotHeader, is_blank
from kvtier.io.index_file import SlotLayout, newest_per_key, parse_index, valid_header

if TYPE_CHECKING:  # disk.py imports this module
    from kvtier.io.cachedir import CacheDir
    from kvtier.io.result import IOResult
    from kvtier.tiers.disk import _Path


@dataclass(frozen=True)
class RecoveredSlot:
    slot: int
    header: SlotHeader


@dataclass(frozen=True)
class RecoveryReport:
    slots: list[RecoveredSlot]
    scanned: int
    torn: int  # headers that do not check out
    duplicates: int  # older copies of a key found in another slot


class DiskRecovery:
    """Start-up recovery of ``DiskTier`` (uses its paths, layout and per-slot arrays)."""

    # what this part uses of DiskTier, which sets all of these in its __init__
    _paths: list[_Path]
    ns_digest: bytes
    layout: SlotLayout
    stride: int
    _lengths: np.ndarray
    _codecs: np.ndarray
    _generation: Iterator[int]
    _header_buffer: Callable[[], np.ndarray]
    _where: Callable[[int], tuple[_Path, CacheDir | None, int, int]]
    _failed: Callable[[_Path, OSError, CacheDir], IOResult]

    def recover(self, threads: int = 8) -> RecoveryReport:
        """Rebuild the slot map: from each path's index file, or by scanning slot headers
        (``threads`` at a time) where the index is missing. Newest copy of each key wins."""
        found: list[tuple[int, SlotHeader]] = []
        scanned = torn = 0
        for index, path in enumerate(self._paths):
            if path.dir is None:
                continue
            entries = path.dir.read_index()
            if entries:
                part, n, bad = self._parse_index(index, path.dir, entries)
            else:
                part, n, bad = self.scan_headers(self._written_slots(index, path.dir), threads)
                for slot, header in part:  # rebuild the index for the next start
                    encoded = cast(bytes, header.encode())  # bytes: no ``into`` given
                    path.dir.write_index(slot // len(self._paths),
                                         np.frombuffer(encoded, dtype=np.uint8))
            found += part
            scanned += n
            torn += bad
        newest, duplicates = newest_per_key(found)
        best = {key: RecoveredSlot(slot, header) for key, (slot, header) in newest.items()}
        last_generation = max((r.header.generation for r in best.values()), default=0)
        self._generation = itertools.count(max(last_generation + 1, time.time_ns()))
        for recovered in best.values():
            self._lengths[recovered.slot] = recovered.header.payload_bytes
            self._codecs[recovered.slot] = recovered.header.codec
        return RecoveryReport(list(best.values()), scanned, torn, duplicates)

    def _parse_index(self, index: int, directory: CacheDir,
                     entries: bytes) -> tuple[list[tuple[int, SlotHeader]], int, int]:
        found, torn = parse_index(entries, self.ns_digest, self.layout, index)
        present = []
        for slot, header in found:  # entries for slots past the end of a truncated file
            number, offset = directory.locate(slot // len(self._paths))
            if directory.file_size(number) < offset + self.stride:
                torn += 1
            else:
                present.append((slot, header))
        return present, min(len(entries) // INDEX_ENTRY_BYTES, self.layout.per_path), torn

    def _written_slots(self, index: int, directory: CacheDir) -> list[int]:
        """Slots of path ``index`` (open in ``directory``) that lie within its slot files as
        they are (a slot past the end of a file, or of a file never made, holds nothing): a scan
        costs what was written, not what the capacity allows."""
        paths = len(self._paths)
        slots: list[int] = []
        for number in directory.slot_file_numbers():
            first = number * directory.file_slots
            count = min(directory.file_size(number) // self.stride, directory.slots_in_file(number))
            slots += range((first * paths) + index, (first + count) * paths + index, paths)
        return slots

    def scan_headers(self, slots: list[int] | range,
                     threads: int = 8) -> tuple[list[tuple[int, SlotHeader]], int, int]:
        """(valid headers, slots scanned, bad slots) read from the slots themselves."""
        step = -(-len(slots) // threads) or 1
        parts = [slots[i:i + step] for i in range(0, len(slots), step)]
        with ThreadPoolExecutor(max(1, min(len(parts), threads))) as pool:
            scans = list(pool.map(self._scan, parts))
        return ([f for part in scans for f in part[0]], sum(p[1] for p in scans),
                sum(p[2] for p in scans))

    def _scan(self, slots: list[int] | range) -> tuple[list[tuple[int, SlotHeader]], int, int]:
        """(valid headers found, slots scanned, bad slots) over ``slots``."""
        found: list[tuple[int, SlotHeader]] = []
        scanned = torn = 0
        header_buf = self._header_buffer()
        for slot in slots:
            path, directory, number, offset = self._where(slot)
            if directory is None or directory.file_size(number) < offset + self.stride:
                continue  # path down, or never written this far
            scanned += 1
            header, bad = self._read_header(path, directory, number, offset, header_buf)
            torn += bad
            if header is not None:
                found.append((slot, header))
        return found, scanned, torn

    def _read_header(self, path: _Path, directory: CacheDir, number: int, offset: int,
                     buf: np.ndarray) -> tuple[SlotHeader | None, bool]:
        """(the slot's header if valid and of this namespace, whether the slot is bad)."""
        try:
            if os.preadv(directory.fd(number), [buf.data], offset) != HEADER_BYTES:
                return None, True
        except OSError as exc:
            self._failed(path, exc, directory)
            return None, True
        if is_blank(buf.data):
            return None, False
        header = valid_header(buf, self.ns_digest, self.layout)
        return header, header is None

