"""The machine's busy cores over a stretch of time, and fio's figure with them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench import busy as busy_module
from kvtier.bench.busy import Busy
from kvtier.bench.fio import fio_bandwidth, fio_figure, have_fio


def test_busy_counts_every_tick_not_idle_or_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    ticks = iter([(1000, 600), (1000 + 3 * hz, 600 + hz)])  # (all, idle + iowait)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(Busy, "_ticks", staticmethod(lambda: next(ticks)))
    monkeypatch.setattr(busy_module.time, "perf_counter", lambda: next(clock))
    with Busy() as busy:
        pass
    assert busy.cores == pytest.approx(1.0)  # 2 s of busy ticks over 2 s


def test_busy_reads_the_first_line_of_proc_stat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100 20 1 1 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        stat if path == "/proc/stat" else path, *a, **k))
    assert Busy._ticks() == (137, 120)  # user..steal summed; idle + iowait


def test_busy_is_zero_where_proc_stat_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise PermissionError("no /proc here")

    monkeypatch.setattr("builtins.open", refuse)
    with Busy() as busy:
        pass
    assert busy.cores == 0.0


@pytest.mark.skipif(not have_fio(), reason="fio is not installed")
def test_fio_figure_is_fio_bandwidth_with_the_cores_busy(tmp_path: Path) -> None:
    figure = fio_figure(tmp_path, "read", 2**20, 8 * 2**20, 2, direct=False)
    assert figure.gib_s > 0 and figure.cores >= 0  # (a short run: ticks of 10 ms, no upper bound)
    assert fio_bandwidth(tmp_path, "write", 2**20, 8 * 2**20, 2, direct=False) > 0
    assert not list(tmp_path.iterdir())  # its file removed
