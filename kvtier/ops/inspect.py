"""``kvtier inspect``: what each namespace under a cache root holds."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from kvtier.keys import FORMAT_VERSION
from kvtier.ops.cache import NamespaceDir, in_use, index_entries


@dataclass
class NamespaceReport:
    id: str
    status: str  # ok | stale (another format version) | orphaned (no readable namespace.json)
    in_use: bool
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
    ns = directory.namespace
    files = directory.slot_files
    version = ns.get("format_version", 0)
    status = "orphaned" if not ns else ("ok" if version == FORMAT_VERSION else "stale")
    report = NamespaceReport(
        id=directory.id, status=status, in_use=in_use(directory), model=ns.get("model", ""),
        kv_dtype=ns.get("kv_dtype", ""), layout=ns.get("layout", ""),
        chunk_tokens=ns.get("chunk_tokens", 0), block_tokens=ns.get("block_tokens", 0),
        tp=f"{ns.get('tp_rank', 0)}/{ns.get('tp_size', 1)}" if ns else "", format_version=version,
        files=len(files), file_bytes=sum(f.stat().st_size for f in files))
    if directory.stride:
        report.slots = report.file_bytes // directory.stride
    now = time.time() if now is None else now
    ages = []
    for _, header in index_entries(directory):
        if header is None:
            report.bad_index_entries += 1
            continue
        report.chunks += 1
        report.stored_bytes += header.payload_bytes
        report.raw_bytes += header.raw_bytes
        ages.append(max(0.0, now - header.created_ns / 1e9))
    if ages:
        report.age_seconds = {"min": min(ages), "median": statistics.median(ages), "max": max(ages)}
    return report

