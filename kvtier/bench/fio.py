"""fio on the same directory, I/O size and queue depth: the ceiling kvtier is compared to."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

from kvtier.bench.busy import Busy


def have_fio() -> bool:
    return shutil.which("fio") is not None


class FioFigure(NamedTuple):
    gib_s: float  # the better shape's GiB/s
    cores: float  # the machine's cores busy during that run (the device's own threads too)


def fio_bandwidth(directory: Path, rw: str, block: int, size: int, depth: int,
                  direct: bool = True) -> float:
    """GiB/s of fio reading or writing ``size`` bytes of ``directory`` sequentially in
    ``block``-byte I/Os with ``depth`` in flight: the better of one libaio job at iodepth
    ``depth`` and ``depth`` psync jobs on their own regions. Writes overwrite a file laid out
    first, as kvtier's slots are overwritten in steady state."""
    return fio_figure(directory, rw, block, size, depth, direct).gib_s


def fio_figure(directory: Path, rw: str, block: int, size: int, depth: int,
               direct: bool = True) -> FioFigure:
    """``fio_bandwidth``, with the cores the machine kept busy during the better run."""
    target = directory / "fio-bench.dat"
    size = max(size - size % (block * depth), block * depth)  # whole I/Os, at least one each
    common = ["fio", "--name=kvtier", f"--filename={target}", f"--bs={block}", f"--rw={rw}",
              f"--direct={int(direct)}", "--output-format=json", "--group_reporting",
              f"--end_fsync={int(not direct)}"]  # O_DIRECT data is on the device already
    shapes = [[f"--size={size}", "--ioengine=libaio", f"--iodepth={depth}"],
              [f"--size={size // depth}", "--ioengine=psync", f"--numjobs={depth}",
               f"--offset_increment={size // depth}"]]
    best = FioFigure(0.0, 0.0)
    try:
        subprocess.run([*common[:3], f"--size={size}", "--rw=write", f"--bs={block}"],
                       capture_output=True, check=True, text=True)  # lay the file out once
        for shape in shapes:
            with Busy() as busy:
                result = subprocess.run([*common, *shape], capture_output=True, check=True, text=True)
            job = json.loads(result.stdout)["jobs"][0][rw]
            best = max(best, FioFigure(job["bw_bytes"] / 2**30, busy.cores))
    except subprocess.CalledProcessError as exc:  # a full or failing disk, as kvtier's own I/O
        said = (exc.stderr or exc.stdout or "").strip() or "no output"
        raise OSError(f"fio failed on {directory}: {said.splitlines()[-1]}") from exc
    finally:
        target.unlink(missing_ok=True)
    return best
