"""What the offline commands make of a segment's index read entry by entry (the numbers they
keep are machine integers): a chunk's time is any 64-bit unsigned number a header holds;
a segment whose index fails part-way counts nothing of it; ``gc --older-than`` compares
times to the nanosecond; segments are freed in the order of their first victim."""

import errno
import math
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvtier.io.format import INDEX_ENTRY_BYTES, decode_header
from kvtier.ops import victims as victims_module
from kvtier.ops.cache import NamespaceDir, Segment, namespaces
from kvtier.ops.inspect import inspect_namespace
from kvtier.ops.victims import SegmentChunks, victims
from kvtier.segment import index_file
from tests.helpers.hostile import make_cache


def test_a_chunk_whose_time_is_past_2_63_ns_is_inspected_as_just_written(tmp_path):
    """A header's time is any 64-bit unsigned number (a hostile or broken writer's)."""
    segment = make_cache(tmp_path / "cache", 3)
    index = segment / "index.kvt"
    data = bytearray(index.read_bytes())
    for slot, created in enumerate([(1 << 64) - 1, 1 << 63, time.time_ns()]):
        at = slot * INDEX_ENTRY_BYTES
        header = replace(decode_header(bytes(data[at:at + INDEX_ENTRY_BYTES])), created_ns=created)
        data[at:at + INDEX_ENTRY_BYTES] = header.encode()[:INDEX_ENTRY_BYTES]
    index.write_bytes(bytes(data))
    (report,) = [inspect_namespace(d) for d in namespaces(tmp_path / "cache")]
    assert report.chunks == 3 and report.age_seconds["min"] == report.age_seconds["median"] == 0.0


def test_a_segment_whose_index_fails_part_way_counts_none_of_it(tmp_path, monkeypatch):
    make_cache(tmp_path / "cache", 6)
    monkeypatch.setattr(index_file, "INDEX_PIECE_ENTRIES", 2)
    real, calls = index_file.read_at, []

    def second_piece_fails(fd, length, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        return real(fd, length, offset)

    monkeypatch.setattr(index_file, "read_at", second_piece_fails)
    (report,) = [inspect_namespace(d) for d in namespaces(tmp_path / "cache")]
    (writer,) = report.writers
    assert writer.status == "unsafe" and "injected" in writer.problem
    assert writer.chunks == report.chunks == 0 and report.stored_bytes == 0


def written(writer, *chunks):
    """``writer``'s segment holding ``chunks``, each ``(generation, created_ns)``."""
    ns = NamespaceDir(Path("/cache"), "0" * 32, None)
    generations = np.array([generation for generation, _ in chunks], dtype=np.uint64)
    created = np.array([at for _, at in chunks], dtype=np.uint64)
    return SegmentChunks(Segment(ns, writer), generations.astype(np.int64), generations,
                         created, np.ones(len(chunks), dtype=np.int64))


NOW = 1_796_667_251_691_798_737  # nanoseconds: a float64 of it is off by up to 256


def test_older_than_compares_a_chunks_time_to_the_nanosecond(monkeypatch):
    monkeypatch.setattr(victims_module, "time", SimpleNamespace(time_ns=lambda: NOW))
    cutoff = math.ceil(NOW - 1.0 * 1e9)  # --older-than 1s: the first time not older
    just_before, at = written("a", (1, cutoff - 1)), written("b", (1, cutoff))
    assert [g.segment.writer for g, _ in victims([just_before, at], 1.0, None)] == ["a"]
    assert victims([written("c", (1, cutoff + 1))], 1.0, None) == []
    assert victims([written("d", (1, 0))], time.time() + 10**10, None) == []  # before 1970
    assert len(victims([written("e", ((1 << 63) - 1, (1 << 64) - 1))], -1e12, None)) == 1


def test_segments_are_freed_in_the_order_of_their_first_victim():
    a = written("a", (1, 5 * 10**9), (2, 5 * 10**9 + 1))
    b = written("b", (1, 10**9))  # the oldest window
    assert [g.segment.writer for g, _ in victims([a, b], None, 0)] == ["b", "a"]
