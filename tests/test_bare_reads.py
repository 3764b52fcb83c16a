"""The bare-Python read floor of bench_store: it reads every chunk, checked or not, and
refuses shapes it cannot scatter."""

import os

import pytest

from kvtier.bench import bare_reads
from kvtier.bench.bare_reads import bare_read_bandwidth


def test_reads_every_chunk_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(bare_reads, "drop_page_cache", lambda: None)
    calls = []
    real = os.preadv

    def counted(fd, iov, offset):
        calls.append((offset, sum(len(b) for b in iov)))
        return real(fd, iov, offset)

    monkeypatch.setattr(bare_reads.os, "preadv", counted)
    chunk = 64 * 1024
    try:
        figure = bare_read_bandwidth(tmp_path, chunk, 40 * chunk, rows=4, prefix_bytes=8 * chunk,
                                     threads=3, run=3)
    except OSError as exc:  # a filesystem without O_DIRECT
        pytest.skip(f"O_DIRECT: {exc}")
    assert figure.gib_s > 0 and figure.cpu_per_gib >= 0
    stride = bare_reads.HEADER + chunk
    assert sorted(offset for offset, _ in calls) == list(range(0, 40 * stride, 3 * stride))
    assert sum(size for _, size in calls) == 40 * stride
    assert not list(tmp_path.iterdir())  # the file is removed


def test_a_short_read_fails_the_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(bare_reads, "drop_page_cache", lambda: None)
    monkeypatch.setattr(bare_reads.os, "preadv", lambda fd, iov, offset: 0)
    with pytest.raises(OSError, match="short read"):
        bare_read_bandwidth(tmp_path, 64 * 1024, 8 * 64 * 1024, rows=4, prefix_bytes=4 * 64 * 1024,
                            verify=False)


def test_rows_that_are_not_whole_pages_are_refused(tmp_path):
    with pytest.raises(ValueError, match="whole pages"):
        bare_read_bandwidth(tmp_path, 64 * 1024, 2**20, rows=64, prefix_bytes=2**20)
