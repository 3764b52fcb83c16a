"""What every transfer returns: an outcome, never an exception.

A disk read or write, a move between tiers, a load in the vLLM worker: each ends in an
``IOResult``. Its ``status`` says what happened (a checksum that failed is ``CORRUPT``, a
device error ``IO_ERROR``...), and the caller turns it into a miss, a counter and a log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class IOStatus(Enum):
    OK = "ok"
    CORRUPT = "corrupt"  # header or payload does not check out: a miss, the slot is bad
    IO_ERROR = "io_error"  # the device failed this request
    NO_SPACE = "no_space"  # free-space floor reached, or ENOSPC
    PATH_DOWN = "path_down"  # the path is out of service
    TIMED_OUT = "timed_out"  # not over within load_timeout: a miss (the read may still end)
    MISSING = "missing"  # not there: a remote store's value (never put, or evicted), or
    # another writer's slot file (gone, or not kvtier's)


@dataclass(frozen=True)
class IOResult:
    status: IOStatus
    nbytes: int = 0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is IOStatus.OK
