"""A worker's counters and load times, importable without vLLM: ``connector.py`` hands them
to vLLM as its connector statistics (``KVTierStats``), which vLLM logs with its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_COUNTERS = ("loads", "chunks_from_host", "chunks_from_disk", "load_bytes_host",
             "load_bytes_disk", "load_failures", "stores", "store_bytes", "disk_writes",
             "disk_write_bytes", "disk_write_failures", "corruptions", "io_errors", "no_space",
             "paths_down", "load_timeouts", "chunks_from_remote", "remote_writes",
             "remote_write_bytes", "remote_failures", "disk_read_bytes", "chunks_from_shared",
             "load_bytes_shared", "load_bytes_remote")
SOURCES = ("disk", "shared", "remote")  # where a chunk read into a host slot came from


def source_of(chunk: Any) -> str:
    """Where ``chunk`` (a ``ChunkLoad`` that is ``staged``) is read from: one of ``SOURCES``."""
    return "remote" if chunk.remote else "shared" if chunk.other is not None else "disk"


@dataclass
class WorkerCounters:
    """Counters and load times since the last report, summed over workers."""

    data: dict[str, Any] = field(default_factory=dict)
    keep_times: bool = True  # each load's time (for percentiles); False: only their sum

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)
        self.data.setdefault("load_seconds", [])
        self.data.setdefault("load_seconds_sum", 0.0)

    def record_load(self, chunks: dict[str, int], copied: dict[str, int], host_bytes: int,
                    seconds: float, failed: int, read_bytes: int = 0) -> None:
        """A load over: ``chunks[where]`` chunks copied into GPU blocks from host memory
        (``host``) or read into a host slot first from each of ``SOURCES`` (never one it
        did not copy: cut, or after a failure); of the ``host_bytes`` copied,
        ``copied[source]`` came from each source, and its disk reads (this rank's and other
        engines' segments) read ``read_bytes`` in all; ``failed`` reads failed."""
        self.data["loads"] += 1
        self.data["chunks_from_host"] += chunks.get("host", 0)
        for source in SOURCES:
            self.data[f"chunks_from_{source}"] += chunks.get(source, 0)
            self.data[f"load_bytes_{source}"] += copied.get(source, 0)
        self.data["load_bytes_host"] += host_bytes
        self.data["load_failures"] += failed
        self.data["disk_read_bytes"] += read_bytes
        self.data["load_seconds_sum"] += seconds
        if self.keep_times:
            self.data["load_seconds"].append(seconds)

    def record_stores(self, chunks: int, nbytes: int) -> None:
        self.data["stores"] += chunks
        self.data["store_bytes"] += nbytes

    def record_disk_writes(self, results: Sequence) -> None:
        for result in results:
            if result.ok:
                self.data["disk_writes"] += 1
                self.data["disk_write_bytes"] += result.nbytes
            else:
                self.data["disk_write_failures"] += 1

    def record_remote_writes(self, results: Sequence) -> None:
        for result in results:
            if result.ok:
                self.data["remote_writes"] += 1
                self.data["remote_write_bytes"] += result.nbytes
            else:
                self.data["remote_failures"] += 1

    def record_failure(self, counter: str) -> None:
        """One more failure of the kind ``counter`` (a name of ``FAILURE_COUNTERS``)."""
        self.data[counter] += 1

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def merge(self, other: Any) -> WorkerCounters:
        """Add ``other``'s counters (anything with the same ``data``) to these; return self."""
        for name in _COUNTERS:
            self.data[name] += other.data.get(name, 0)
        self.data["load_seconds"] = self.data["load_seconds"] + list(other.data.get("load_seconds", []))
        self.data["load_seconds_sum"] += other.data.get("load_seconds_sum", 0.0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTERS}
        seconds = sorted(self.data["load_seconds"])
        if seconds:
            out["load_ms_p50"] = round(1000 * seconds[len(seconds) // 2], 2)
            out["load_ms_max"] = round(1000 * seconds[-1], 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in _COUNTERS)
