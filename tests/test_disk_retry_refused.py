"""A path's retry the I/O engine refuses is not started, and the path is tried again at the
next poll: it is never left marked as being tried for ever, and the refusal never reaches
the caller of ``poll`` (every store call makes one)."""

import threading
from types import SimpleNamespace

from kvtier.disk.retry import DiskRetries


class Disk:
    """A path that comes back, read back already (it comes back empty, at once)."""

    def __init__(self) -> None:
        self.queues, self.revived = ["path-0"], 0
        self.paths = SimpleNamespace(answer_timeout=None, states=[SimpleNamespace(read_back=True)])

    def revive_due(self) -> list[int]:
        return [0]

    def revive(self, index: int) -> bool:
        self.revived += 1
        return True


class Engine:
    """Refuses its first ``refusals`` submits (closed); runs the others at once."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals

    def submit(self, queue_name, job):
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("kvtier I/O engine is closed")
        job()


def test_a_refused_retry_is_made_again_at_the_next_poll():
    disk, back = Disk(), []
    retries = DiskRetries(disk, Engine(refusals=1), threading.Lock(),
                          lambda index, found: back.append((index, found)))
    retries.poll()  # refused: nothing raised, nothing tried
    assert disk.revived == 0 and back == []
    retries.poll()
    assert disk.revived == 1 and back == [(0, [])]
