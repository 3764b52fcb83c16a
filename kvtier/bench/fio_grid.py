"""fio's best on a directory over engines, job counts and queue depths: the ceiling a user's
drive gives, whatever shape reaches it.

``fio_grid_best`` runs fio on every shape (``engine`` x ``jobs`` x ``depth``: each job its
own region of one file, ``depth`` I/Os in flight each), one shape after another, each for
``seconds`` (over its region again when it reaches the end: the grid takes the same time on
a slow drive and a fast one), reading or writing a ``size``-byte file in ``block``-byte
O_DIRECT I/Os, and returns the best shape's GiB/s
with the machine's cores busy meanwhile (over that engine's shapes: one fio process runs
them all). Writes overwrite the file laid out first (kvtier's slots are overwritten in
steady state). An engine fio refuses (one the kernel lacks, such as io_uring turned off)
is left out; when every one is, ``OSError`` says why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from kvtier.bench.busy import Busy

ENGINES = ("libaio", "io_uring")
JOBS = (1, 2, 4)
DEPTHS = (1, 4, 8, 16, 32)


class FioShape(NamedTuple):
    engine: str
    jobs: int
    depth: int

    def __str__(self) -> str:
        return f"{self.engine} {self.jobs}x{self.depth}"


class FioBest(NamedTuple):
    gib_s: float
    cores: float  # the machine's cores busy during the best run
    shape: FioShape


def fio_grid_best(directory: Path, rw: str, block: int, size: int,
                  engines: Sequence[str] = ENGINES, jobs: Sequence[int] = JOBS,
                  depths: Sequence[int] = DEPTHS, seconds: float = 0.5,
                  direct: bool = True) -> FioBest:
    """The best of fio over every shape (module docstring); ``direct=False`` for a
    filesystem without O_DIRECT."""
    target = directory / "fio-grid.dat"
    size = max(size - size % (block * max(jobs)), block * max(jobs))  # whole I/Os per job
    found: list[FioBest] = []
    refused = "no engine"
    try:
        _run(["fio", "--name=layout", f"--filename={target}", f"--size={size}", "--rw=write",
              f"--bs={block}"])
        for engine in engines:
            shapes = [FioShape(engine, j, d) for j in jobs for d in depths]
            try:
                found += _shapes(target, rw, block, size, shapes, seconds, direct)
            except subprocess.CalledProcessError as exc:
                said = (exc.stderr or exc.stdout or "").strip() or "no output"
                refused = f"{engine}: {said.splitlines()[-1]}"
    finally:
        target.unlink(missing_ok=True)
    if not found:
        raise OSError(f"fio ran no shape on {directory}: {refused}")
    return max(found)


def _shapes(target: Path, rw: str, block: int, size: int, shapes: list[FioShape],
            seconds: float, direct: bool) -> list[FioBest]:
    """Each shape's figure, from one fio process that runs them one after another."""
    command = ["fio", f"--filename={target}", f"--bs={block}", f"--rw={rw}", f"--direct={int(direct)}",
               "--output-format=json", "--group_reporting", "--thread", "--time_based",
               f"--runtime={max(1, round(seconds * 1000))}ms"]
    for i, shape in enumerate(shapes):
        share = size // shape.jobs
        command += [f"--name={shape.engine}-{shape.jobs}x{shape.depth}", "--new_group",
                    "--stonewall", f"--ioengine={shape.engine}", f"--iodepth={shape.depth}",
                    f"--numjobs={shape.jobs}", f"--size={share}", f"--offset_increment={share}"]
        if i == 0:
            command.remove("--new_group")
    with Busy() as busy:
        out = _run(command)
    groups = json.loads(out[out.find("{"):])["jobs"]  # after any notes fio printed
    assert len(groups) == len(shapes), f"fio reported {len(groups)} groups for {len(shapes)} shapes"
    return [FioBest(g[rw]["bw_bytes"] / 2**30, busy.cores, shape)
            for g, shape in zip(groups, shapes, strict=True)]


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, check=True, text=True).stdout
