"""The naive baseline: one buffered file per chunk, written and read one at a time."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np


def drop_cache(paths: list[Path]) -> None:
    """Write back and drop ``paths`` from the page cache so reads reach the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache() -> None:
    """Write back and drop the whole page cache (root only; otherwise only O_DIRECT reads
    are sure to reach the device)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def naive_round_trip(directory: Path, chunks: list[np.ndarray], passes: int = 3) -> tuple[float, float]:
    """(write GiB/s, read GiB/s) of one file per chunk, one at a time, buffered; the best
    of ``passes`` each way, as kvtier's own figures are.

    The write figure includes the final sync (the bytes reach the device); reads start
    with the files dropped from the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"chunk-{i:06d}.bin" for i in range(len(chunks))]
    total = sum(c.nbytes for c in chunks) / 2**30
    write_s = read_s = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for path, chunk in zip(paths, chunks, strict=True):
            with open(path, "wb") as f:
                f.write(chunk.data)
        os.sync()
        write_s = min(write_s, time.perf_counter() - start)
        drop_cache(paths)
        start = time.perf_counter()
        for path, chunk in zip(paths, chunks, strict=True):
            with open(path, "rb") as f:
                data = f.read()
            assert len(data) == chunk.nbytes
        read_s = min(read_s, time.perf_counter() - start)
        for path in paths:
            path.unlink()
    return total / write_s, total / read_s
