"""The bare-Python read floor of bench_store: it reads every chunk once, scatters each over
its rows of the prefix buffer, and refuses shapes it cannot scatter."""

import errno
import os
from collections import Counter

import numpy as np
import pytest

from kvtier.bench import bare_reads
from kvtier.bench.bare_reads import bare_read_bandwidth


@pytest.fixture
def direct_dir(tmp_path):
    """``tmp_path``, where O_DIRECT opens work (else the test is skipped)."""
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"no O_DIRECT on {tmp_path}")
    probe.unlink()
    return tmp_path


def test_reads_every_chunk_once_into_its_rows(direct_dir, monkeypatch):
    monkeypatch.setattr(bare_reads, "drop_page_cache", lambda: None)
    calls, real = [], os.preadv

    def counted(fd, iov, offset):
        calls.append((offset, [(np.frombuffer(b, np.uint8).ctypes.data, len(b)) for b in iov]))
        return real(fd, iov, offset)

    monkeypatch.setattr(bare_reads.os, "preadv", counted)
    chunk, rows, per_prefix, count, run = 64 * 1024, 4, 8, 40, 3
    figure = bare_read_bandwidth(direct_dir, chunk, count * chunk, rows=rows,
                                 prefix_bytes=per_prefix * chunk, threads=3, run=run)
    assert figure.gib_s > 0 and figure.cpu_per_gib >= 0
    stride = bare_reads.HEADER + chunk
    assert sorted(offset for offset, _ in calls) == list(range(0, count * stride, run * stride))
    assert sum(size for _, pieces in calls for _, size in pieces) == count * stride
    # each call: per chunk a header, then its rows; row r of chunk c lands at
    # r * plane + (c % per_prefix) * row of the prefix buffer
    row, plane = chunk // rows, per_prefix * chunk // rows
    landed = [(offset // stride + j, address) for offset, pieces in calls
              for j in range(len(pieces) // (1 + rows))
              for address, _ in pieces[j * (1 + rows) + 1:(j + 1) * (1 + rows)]]
    base = min(address for _, address in landed)
    where = Counter((c % per_prefix, address - base) for c, address in landed)
    assert where == Counter({(c, r * plane + c * row): count // per_prefix
                             for c in range(per_prefix) for r in range(rows)})
    assert not list(direct_dir.iterdir())  # the file is removed


def test_a_short_read_fails_the_figure_and_leaves_no_file(direct_dir, monkeypatch):
    monkeypatch.setattr(bare_reads, "drop_page_cache", lambda: None)
    monkeypatch.setattr(bare_reads.os, "preadv", lambda fd, iov, offset: 0)
    with pytest.raises(OSError, match="short read"):
        bare_read_bandwidth(direct_dir, 64 * 1024, 8 * 64 * 1024, rows=4, prefix_bytes=4 * 64 * 1024,
                            verify=False)
    assert not list(direct_dir.iterdir())


def test_rows_that_are_not_whole_pages_are_refused(tmp_path):
    with pytest.raises(ValueError, match="whole pages"):
        bare_read_bandwidth(tmp_path, 64 * 1024, 2**20, rows=64, prefix_bytes=2**20)
