"""fio's best over engines, jobs and depths: every shape run, the best one kept with its shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import fio_grid
from kvtier.bench.fio import have_fio
from kvtier.bench.fio_grid import FioShape, fio_grid_best

pytestmark = pytest.mark.skipif(not have_fio(), reason="fio is not installed")
SMALL = {"jobs": (1, 2), "depths": (1, 4), "seconds": 0.05, "direct": False}


def test_the_best_shape_is_one_of_the_grid_and_the_file_goes(tmp_path: Path) -> None:
    best = fio_grid_best(tmp_path, "read", 2**16, 2**20, engines=("libaio",), **SMALL)
    assert best.gib_s > 0 and best.cores >= 0
    assert best.shape in {FioShape("libaio", j, d) for j in (1, 2) for d in (1, 4)}
    assert str(best.shape).startswith("libaio ")
    assert not list(tmp_path.iterdir())


def test_every_shape_is_run_and_the_fastest_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[FioShape]] = []
    real = fio_grid._shapes

    def recording(target, rw, block, size, shapes, *rest):
        ran.append(shapes)
        return real(target, rw, block, size, shapes, *rest)
    monkeypatch.setattr(fio_grid, "_shapes", recording)
    best = fio_grid_best(tmp_path, "write", 2**16, 2**20, engines=("libaio", "psync"), **SMALL)
    assert [len(shapes) for shapes in ran] == [4, 4]  # one fio process per engine, every shape
    assert best.shape.engine in ("libaio", "psync")


def test_an_engine_fio_refuses_is_left_out(tmp_path: Path) -> None:
    best = fio_grid_best(tmp_path, "read", 2**16, 2**20, engines=("no-such-engine", "psync"), **SMALL)
    assert best.shape.engine == "psync"
    with pytest.raises(OSError, match=r"ran no shape.*no-such-engine"):
        fio_grid_best(tmp_path, "read", 2**16, 2**20, engines=("no-such-engine",), **SMALL)
    assert not list(tmp_path.iterdir())
