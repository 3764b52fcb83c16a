"""Vectored reads and writes carried to their end: a call that moves fewer bytes than asked
(Linux moves at most 2 GiB - 4 KiB in one; a network or FUSE filesystem may stop early) is
followed by another from where it stopped, so a good chunk is never taken for truncated, nor
a good write for failed; and a run of slots never asks one call for more than ``RUN_BYTES``."""

import os

import numpy as np
import pytest

from kvtier import KVStore
from kvtier.io.vectored import RUN_BYTES, read_fully, write_fully
from kvtier.segment.index_file import SlotLayout
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, exact, seq

STEP = 5000  # bytes one call moves at most, in the tests that cut calls short


def short_calls(monkeypatch, match: str = "") -> list[int]:
    """Make ``os.preadv``/``os.pwritev`` on files whose path holds ``match`` move at most
    ``STEP`` bytes a call, as a filesystem that stops early may; the sizes asked are listed."""
    asked: list[int] = []

    def cut(real):
        def call(fd, buffers, offset):
            if match not in os.readlink(f"/proc/self/fd/{fd}"):
                return real(fd, buffers, offset)
            views = [memoryview(b).cast("B") for b in buffers]
            asked.append(sum(v.nbytes for v in views))
            first = next(v for v in views if v.nbytes)
            return real(fd, [first[:STEP]], offset)
        return call

    monkeypatch.setattr(os, "preadv", cut(os.preadv))
    monkeypatch.setattr(os, "pwritev", cut(os.pwritev))
    return asked


def test_reads_and_writes_go_on_after_short_calls(tmp_path, monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, 3 * STEP + 17, dtype=np.uint8)
    path = tmp_path / "f"
    asked = short_calls(monkeypatch, "f")
    with open(path, "wb+") as f:
        assert write_fully(f.fileno(), [data[:7], data[7:]], 100) == data.size
        head, rest = np.zeros(7, np.uint8), np.zeros(data.size - 7, np.uint8)
        assert read_fully(f.fileno(), [head, rest], 100) == data.size
    assert bytes(head) + bytes(rest) == bytes(data) and len(asked) > 6


def test_a_read_past_the_end_of_the_file_stops_there(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    buffers = [np.zeros(4, np.uint8), np.zeros(100, np.uint8)]
    with open(path, "rb") as f:
        assert read_fully(f.fileno(), buffers, 2) == 8


def test_a_store_on_a_filesystem_that_stops_short_serves_every_chunk(tmp_path, monkeypatch):
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_chunks=16)) as store:
        asked = short_calls(monkeypatch, "slots-")
        store.put(tokens, make_kv(tokens))
        assert store.flush(30).not_written == 0
        assert exact(store, tokens)  # from disk: host memory holds two of six
        stats = store.stats()
        assert asked and stats.corruptions == 0 and stats.io_errors == 0


@pytest.mark.parametrize("raw_bytes", [4096, 144 << 20, RUN_BYTES])
def test_a_run_of_slots_asks_one_call_for_at_most_run_bytes(raw_bytes):
    layout = SlotLayout(raw_bytes=raw_bytes, num_paths=1, capacity=40 * (raw_bytes + (1 << 20)))
    runs = layout.runs(list(range(32)), 16)
    assert sorted(i for run in runs for i in run) == list(range(32))
    assert all(len(run) == 1 or len(run) * layout.stride <= RUN_BYTES for run in runs)
    assert max(map(len, runs)) == (16 if raw_bytes == 4096 else 1 if raw_bytes == RUN_BYTES else 7)
