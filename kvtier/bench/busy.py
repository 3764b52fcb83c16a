"""How many of the machine's cores were busy over a stretch of time, from /proc/stat."""

from __future__ import annotations

import os
import time


class Busy:
    """Cores of the whole machine busy (not idle, not waiting for I/O) between ``__enter__``
    and ``__exit__``, every process and the kernel's own threads counted (a RAM-backed loop
    device's copy runs in one); 0.0 where /proc/stat cannot be read."""

    def __init__(self) -> None:
        self.cores = 0.0

    @staticmethod
    def _ticks() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields[:8]), fields[3] + fields[4]  # all, idle + iowait

    def __enter__(self) -> Busy:
        self._start, self._wall = self._ticks(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        end, wall = self._ticks(), time.perf_counter() - self._wall
        if end is None or self._start is None or wall <= 0:
            return
        (total, idle), (total0, idle0) = end, self._start
        self.cores = (total - total0 - (idle - idle0)) / os.sysconf("SC_CLK_TCK") / wall
