"""Reading back what a disk tier holds at start-up: from each path's index file, or by
reading every slot header where an index is missing."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import cast

import numpy as np

from kvtier.disk.paths import DiskPaths, PathState
from kvtier.io.bounded_jobs import path_job_wait, run_bounded
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, SlotHeader, is_blank
from kvtier.segment.cachedir import CacheDir
from kvtier.segment.index_file import Found, SlotLayout, newest_per_key, parse_index, valid_header


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


HEADER_TRIES = 3  # reads of a slot's header in a start-up scan before it is given up


class DiskRecovery:
    """Finds the chunks that the slots of ``paths`` (laid out as ``layout``) hold for the
    namespace ``ns_digest``.

    Contract: ``recover`` reads each path in service (or one: ``only``): its index file when
    it has one (an entry for a slot past the end of its file counts as torn), else every slot
    header within the slot files as they are, and then rebuilds that index. Only headers of
    this namespace that check out are kept, and of several copies of one key the newest. An
    I/O error reading a slot header counts the slot as bad and goes to ``paths.failed``;
    one reading or rebuilding a path's index (a full disk, a failing one) takes that path
    out of service, and what it held is not reported. At start (every path) the paths are
    read at once, and one not read back within ``path_job_wait(answer_timeout)`` (a mount
    that hung after it answered, a long scan) is taken out of service, what it held not
    reported. A path read back whole and still in service is marked so
    (``PathState.read_back``). Nothing else changes: the tier applies the report to its own
    state.
    """

    def __init__(self, paths: DiskPaths, ns_digest: bytes, layout: SlotLayout,
                 answer_timeout: float | None = None) -> None:
        self._paths, self._ns_digest, self._layout = paths, ns_digest, layout
        self._wait = path_job_wait(answer_timeout)

    def recover(self, threads: int = 8, only: int | None = None) -> RecoveryReport:
        """The newest copy of each key, from index files or ``threads`` header scans; with
        ``only``, of that path alone (as long as it takes: the caller runs it on the path's
        own queue)."""
        todo = {index: path.dir for index, path in enumerate(self._paths.states)
                if path.dir is not None and only in (None, index)}
        jobs = {index: partial(self._recover_path, index, directory, threads)
                for index, directory in todo.items()}
        if only is None and self._wait is not None:
            results = run_bounded(jobs, self._wait, "kvtier-read-back")
        else:
            results = {index: _outcome(job) for index, job in jobs.items()}
        found: list[Found] = []
        scanned = torn = 0
        for index, directory in todo.items():
            part = self._path_read(index, directory, results.get(index))
            if part is not None:
                found += part[0]
                scanned += part[1]
                torn += part[2]
        newest, duplicates = newest_per_key(found)
        best = [RecoveredSlot(slot, header) for slot, header in newest.values()]
        return RecoveryReport(best, scanned, torn, duplicates)

    def _path_read(self, index: int, directory: CacheDir | None,
                   result: tuple[list[Found], int, int] | BaseException | None
                   ) -> tuple[list[Found], int, int] | None:
        """Path ``index``'s read-back, or None when it is taken out for it: not over in time,
        or an I/O error (a bug's exception is raised)."""
        path = self._paths.states[index]
        if result is None:
            self._paths.take_down(path, f"not read back within {self._wait:g} s at start (a mount "
                                  "that stopped answering, or a scan of every slot header where "
                                  "its index is missing): read back when it is tried again",
                                  directory)
            return None
        if isinstance(result, OSError):  # a full disk, a failing one: out, as any path that fails
            self._paths.take_down(path, f"cannot read back what it holds: {result}", directory)
            return None
        if isinstance(result, BaseException):
            raise result
        path.read_back = path.dir is directory
        return result

    def _recover_path(self, index: int, directory: CacheDir,
                      threads: int) -> tuple[list[Found], int, int]:
        """(chunks found, slots looked at, bad slots) of path ``index``: from its index file,
        or by a scan of its slot headers, after which the index is written anew, whole or
        not at all (``replace_index``: a crash midway leaves it empty, to be scanned again)."""
        entries = directory.read_index()
        if entries:
            return self._parse_index(index, directory, entries)
        part, n, bad = self.scan_headers(self._written_slots(index, directory), threads)
        if self._paths.states[index].dir is not directory:  # out during the scan: what it
            return part, n, bad  # did not read is not in an index; the next start scans
        paths = self._layout.num_paths
        directory.replace_index((slot // paths, cast(bytes, header.encode())[:INDEX_ENTRY_BYTES])
                                for slot, header in part)  # one header at a time: 4 KiB each
        return part, n, bad

    def _parse_index(self, index: int, directory: CacheDir,
                     entries: bytes) -> tuple[list[Found], int, int]:
        found, torn = parse_index(entries, self._ns_digest, self._layout, index)
        present = []
        for slot, header in found:  # entries for slots past the end of a truncated file
            number, offset = directory.locate(slot // self._layout.num_paths)
            if directory.file_size(number) < offset + self._layout.stride:
                torn += 1
            else:
                present.append((slot, header))
        return present, min(len(entries) // INDEX_ENTRY_BYTES, self._layout.per_path), torn

    def _written_slots(self, index: int, directory: CacheDir) -> list[int]:
        """Slots of path ``index`` (open in ``directory``) that lie within its slot files as
        they are (a slot past the end of a file, or of a file never made, holds nothing): a scan
        costs what was written, not what the capacity allows."""
        paths = self._layout.num_paths
        slots: list[int] = []
        for number in directory.slot_file_numbers():
            first = number * directory.file_slots
            count = min(directory.file_size(number) // self._layout.stride,
                        directory.slots_in_file(number))
            slots += range((first * paths) + index, (first + count) * paths + index, paths)
        return slots

    def scan_headers(self, slots: list[int] | range, threads: int = 8) -> tuple[list[Found], int, int]:
        """(valid headers, slots scanned, bad slots) read from the slots themselves."""
        step = -(-len(slots) // threads) or 1
        parts = [slots[i:i + step] for i in range(0, len(slots), step)]
        with ThreadPoolExecutor(max(1, min(len(parts), threads))) as pool:
            scans = list(pool.map(self._scan, parts))
        return ([f for part in scans for f in part[0]], sum(p[1] for p in scans),
                sum(p[2] for p in scans))

    def _scan(self, slots: list[int] | range) -> tuple[list[Found], int, int]:
        """(valid headers found, slots scanned, bad slots) over ``slots``."""
        found: list[Found] = []
        scanned = torn = 0
        buffer = AlignedBuffer(HEADER_BYTES, pin=False)  # aligned: O_DIRECT reads
        paths, stride = self._layout.num_paths, self._layout.stride
        try:
            for slot in slots:
                path = self._paths.states[slot % paths]
                directory = path.dir
                if directory is None:
                    continue  # path down
                number, offset = directory.locate(slot // paths)
                if directory.file_size(number) < offset + stride:
                    continue  # never written this far
                scanned += 1
                header, bad = self._read_header(path, directory, number, offset, buffer.array)
                torn += bad
                if header is not None:
                    found.append((slot, header))
        finally:
            buffer.close()
        return found, scanned, torn

    def _read_header(self, path: PathState, directory: CacheDir, number: int, offset: int,
                     buf: np.ndarray) -> tuple[SlotHeader | None, bool]:
        """(the slot's header if valid and of this namespace, whether the slot is bad)."""
        for attempt in range(HEADER_TRIES):  # a slot left out here is out of the index
            try:  # written from the scan, for good: a passing error is tried again
                with directory.held():
                    got = os.preadv(directory.fd(number), [buf.data], offset)
                if got != HEADER_BYTES:
                    return None, True
                path.eio_run = 0  # errors count in a row, as a request's do
                break
            except OSError as exc:
                if attempt == HEADER_TRIES - 1:
                    self._paths.failed(path, exc, directory)
                    return None, True
        if is_blank(buf.data):
            return None, False
        header = valid_header(buf, self._ns_digest, self._layout)
        return header, header is None


def _outcome(job: Callable[[], tuple[list[Found], int, int]]) -> tuple[list[Found], int, int] | BaseException:
    """What ``job`` returned, or the ``OSError`` it raised."""
    try:
        return job()
    except OSError as exc:
        return exc
