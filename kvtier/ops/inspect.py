"""``kvtier inspect``: what each namespace under a cache root holds, writer by writer."""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.io.format import SlotHeader
from kvtier.ops.cache import NamespaceDir, Segment, error_text, halt_unknown, slot_file_sizes
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.segments import busy_reason, file_problem, index_entries, top_lock_held
from kvtier.segment.halt_file import HaltFile
from kvtier.segment.lease import read_lease
from kvtier.segment.names import HALT_FILE, LEASE_FILE


@dataclass
class Holdings:
    """What a segment (or all of a namespace's segments) holds."""

    files: int = 0
    file_bytes: int = 0
    slots: int = 0
    chunks: int = 0
    bad_index_entries: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0

    def add(self, other: Holdings) -> None:
        for name in Holdings.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class WriterReport(Holdings):
    """One writer's segment: who its lease says writes it, and what it holds."""

    writer: str = ""
    status: str = "ok"  # ok | unsafe (the segment or one of its files breaks the rule)
    problem: str = ""
    in_use: bool = False  # a process holds its lock (or a fresh lease of another machine)
    host: str = ""  # from the lease; empty when there is none
    pid: int = 0
    beat: int = 0  # heartbeats the lease counts
    lease_age_seconds: float | None = None  # since the lease was written, by the filesystem's clock


@dataclass
class NamespaceReport(Holdings):
    id: str = ""
    status: str = ""  # ok | stale | damaged | orphaned | unsafe: see NamespaceDir.status
    in_use: bool = False
    problem: str = ""  # why the metadata is not trusted, or what is unsafe
    model: str = ""
    kv_dtype: str = ""
    layout: str = ""
    chunk_tokens: int = 0
    block_tokens: int = 0
    tp: str = ""
    model_settings: str = ""  # a vLLM engine's digest of what else changes the KV bytes
    format_version: int = 0
    age_seconds: dict[str, float] = field(default_factory=dict)
    writers: list[WriterReport] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # entries of writers/ that are not kvtier's
    halted: bool = False  # engines found wrong KV while serving: no hits (halt.json)
    clock_problem: str = ""  # why the filesystem's clock was not read (lease ages not told)

    @property
    def fill(self) -> float:
        return self.chunks / self.slots if self.slots else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["writers"] = [_first(writer, ("writer", "status", "in_use")) for writer in data["writers"]]
        return {**_first(data, ("id", "status", "in_use")), "fill": self.fill,
                "compression_ratio": self.compression_ratio}


def inspect_namespace(directory: NamespaceDir, now: float | None = None) -> NamespaceReport:
    """What ``directory`` holds, from its metadata, and each segment's lease, file sizes and
    index (no slot is read). The filesystem's clock is read once for the namespace
    (``NamespaceClock``: only in a directory kvtier provably wrote), before any lease: a
    lease's age is never overstated; where it is not read, ``clock_problem`` says why."""
    now = time.time() if now is None else now
    clock = NamespaceClock(directory)
    file_now = clock() if directory.segments else None
    ns = directory.namespace
    report = NamespaceReport(
        id=directory.id, status=directory.status, in_use=top_lock_held(directory),
        problem=directory.problem, model=str(ns.get("model", "")),
        kv_dtype=str(ns.get("kv_dtype", "")), layout=str(ns.get("layout", "")),
        chunk_tokens=_int(ns.get("chunk_tokens")), block_tokens=_int(ns.get("block_tokens")),
        tp=f"{ns.get('tp_rank', 0)}/{ns.get('tp_size', 1)}" if ns else "",
        model_settings=str(ns.get("model_settings", "")),
        format_version=_int(ns.get("format_version")), ignored=list(directory.ignored),
        clock_problem=clock.problem)
    report.halted, unknown = HaltFile(directory.root, directory.id).stands()
    if unknown is not None:
        report.problem = "; ".join(filter(None, (report.problem, halt_unknown(
            unknown, str(directory.path / HALT_FILE)))))
    created = array("Q")
    for segment in directory.segments:
        writer, written = inspect_segment(segment, directory.readable, file_now)
        report.writers.append(writer)
        report.add(writer)
        report.in_use = report.in_use or writer.in_use
        created += written
        if writer.status == "unsafe":
            report.status = "unsafe"
            report.problem = "; ".join(filter(None, (report.problem, writer.problem)))
    if created:
        ages = np.maximum(0.0, now - np.frombuffer(created, dtype=np.uint64) / 1e9)
        report.age_seconds = {"min": float(ages.min()), "median": float(np.median(ages)),
                              "max": float(ages.max())}
    return report


def inspect_segment(segment: Segment, readable: bool,
                    file_now: int | None) -> tuple[WriterReport, array[int]]:
    """The report of one segment and when each chunk its index names was written
    (``created_ns``; of a ``readable`` namespace only: the others' geometry is not known),
    the index read entry by entry and only what the report counts kept (8 bytes a chunk);
    ``file_now``: the filesystem's clock (``NamespaceClock``; None: not known, and the
    lease's age not told)."""
    report = WriterReport(writer=segment.writer, status="unsafe" if segment.unsafe else "ok",
                          problem=segment.problem)
    created = array("Q")  # (a header's time is any 64-bit unsigned number)
    if segment.unsafe:
        return report, created
    try:
        with segment.open() as handle:
            problem = file_problem(handle)
            if problem:
                report.status, report.problem = "unsafe", problem
                return report, created
            lease = read_lease(handle)
            written = handle.lstat(LEASE_FILE) if lease is not None else None
            report.in_use = bool(busy_reason(handle, lambda: file_now))
            if readable:
                sizes = slot_file_sizes(segment.meta, handle)
                counted, created = _count_entries(index_entries(segment, handle, sizes))
                report.add(counted)  # (only once the whole index is read)
                report.files, report.file_bytes = len(sizes), sum(sizes.values())
                report.slots = sum(size // segment.meta.stride for size in sizes.values())
    except OSError as exc:
        report.status, report.problem = "unsafe", error_text(exc, str(segment.path))
        return report, array("Q")
    if lease is not None:
        report.host, report.pid, report.beat = lease.host, lease.pid, lease.beat
        if written is not None and file_now is not None:
            report.lease_age_seconds = (file_now - written.st_mtime_ns) / 1e9
    return report, created


def _count_entries(entries: Iterable[tuple[int, SlotHeader | None]]) -> tuple[Holdings, array[int]]:
    """What ``entries`` count (chunks, bytes, bad entries), and each chunk's write time."""
    counted, created = Holdings(), array("Q")
    for _, header in entries:
        if header is None:
            counted.bad_index_entries += 1
            continue
        counted.chunks += 1
        counted.stored_bytes += header.payload_bytes
        counted.raw_bytes += header.raw_bytes
        created.append(header.created_ns)
    return counted, created


def _first(data: dict, keys: tuple[str, ...]) -> dict:
    """``data`` with ``keys`` first (for people reading the JSON)."""
    return {**{key: data[key] for key in keys}, **data}


def _int(value: object) -> int:
    return value if type(value) is int else 0
