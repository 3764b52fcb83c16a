"""``kvtier inspect``: what each namespace under a cache root holds."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from kvtier.ops.cache import NamespaceDir, in_use, index_entries, slot_file_sizes


@dataclass
class NamespaceReport:
    id: str
    status: str  # ok | stale | damaged | orphaned | unsafe: see NamespaceDir.status
    in_use: bool
    problem: str = ""  # why the metadata is not trusted, or what is unsafe
    model: str = ""
    kv_dtype: str = ""
    layout: str = ""
    chunk_tokens: int = 0
    block_tokens: int = 0
    tp: str = ""
    format_version: int = 0
    files: int = 0
    file_bytes: int = 0
    slots: int = 0
    chunks: int = 0
    bad_index_entries: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0
    age_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def fill(self) -> float:
        return self.chunks / self.slots if self.slots else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "fill": self.fill, "compression_ratio": self.compression_ratio}


def inspect_namespace(directory: NamespaceDir, now: float | None = None) -> NamespaceReport:
    """What ``directory`` holds, from its metadata, file sizes and index (no slot is read)."""
    ns = directory.namespace
    report = NamespaceReport(
        id=directory.id, status=directory.status, in_use=in_use(directory),
        problem=directory.problem, model=str(ns.get("model", "")),
        kv_dtype=str(ns.get("kv_dtype", "")), layout=str(ns.get("layout", "")),
        chunk_tokens=_int(ns.get("chunk_tokens")), block_tokens=_int(ns.get("block_tokens")),
        tp=f"{ns.get('tp_rank', 0)}/{ns.get('tp_size', 1)}" if ns else "",
        format_version=_int(ns.get("format_version")))
    if not directory.readable:
        return report
    try:
        with directory.open() as handle:
            sizes = slot_file_sizes(directory, handle)
            entries = index_entries(directory, handle, sizes)
    except OSError as exc:
        report.status, report.problem = "unsafe", exc.strerror or str(exc)
        return report
    report.files, report.file_bytes = len(sizes), sum(sizes.values())
    report.slots = sum(size // directory.readable_meta.stride for size in sizes.values())
    _count_entries(report, entries, time.time() if now is None else now)
    return report


def _count_entries(report: NamespaceReport, entries: list, now: float) -> None:
    ages = []
    for _, header in entries:
        if header is None:
            report.bad_index_entries += 1
            continue
        report.chunks += 1
        report.stored_bytes += header.payload_bytes
        report.raw_bytes += header.raw_bytes
        ages.append(max(0.0, now - header.created_ns / 1e9))
    if ages:
        report.age_seconds = {"min": min(ages), "median": statistics.median(ages), "max": max(ages)}


def _int(value: object) -> int:
    return value if type(value) is int else 0
