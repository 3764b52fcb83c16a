"""One process of tests/test_processes.py: a store under mixed load from several threads.

    python -m tests.helpers.mixed_load DIR SECONDS SEED OUT.json

Threads put and get overlapping prefixes (the families of scripts/soak.py) and check every
byte they get back. Open descriptors and resident memory are sampled once warmed up (a third
of the way) and at the end. Writes what happened to OUT.json, with the store's warnings and
errors (``warnings``: why a path went down, a failed sync, ...) and what the final flush
said (``flush``).
"""

import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from soak import LAYOUT, config, resident_mib, worker

from kvtier import KVStore

THREADS = 3


class Kept(logging.Handler):
    """Keeps the message of every record at WARNING or above (the store's own log)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def sample() -> dict:
    """Descriptors (at the quietest of a few looks: the store's lease and share threads open
    a file for a moment now and then; a leak stays) and resident memory."""
    fds = []
    for _ in range(10):
        fds.append(len(os.listdir("/proc/self/fd")))
        time.sleep(0.02)
    return {"fds": min(fds), "rss_mib": resident_mib()}


if __name__ == "__main__":
    directory, seconds, seed, out = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    counts, lock, stop = Counter(), threading.Lock(), threading.Event()
    kept = Kept()
    logging.getLogger("kvtier").addHandler(kept)
    # load_timeout well above the soak's 1 s: on a busy machine (a CI running other tests
    # beside it) a write stalled that long counts against its path, and with disk_retry off
    # a path taken out stays out, which is not what this test is about
    store = KVStore(LAYOUT, {**config(directory), "disk_retry": "off", "share_writers": 2,
                             "load_timeout": "20s"})
    recovered = store.stats().recovered_chunks
    threads = [threading.Thread(target=worker, args=([store], stop, seed * 100 + i, counts, lock))
               for i in range(THREADS)]
    for t in threads:
        t.start()
    time.sleep(seconds / 3)
    warm = sample()
    time.sleep(2 * seconds / 3)
    end = sample()
    stop.set()
    for t in threads:
        t.join()
    flushed = store.flush()
    stats = store.stats()
    store.close()
    Path(out).write_text(json.dumps({
        "counts": dict(counts), "warm": warm, "end": end, "recovered": recovered,
        "paths_down": stats.paths_down, "disk_writes": stats.disk_writes,
        "disk_reads": stats.disk_reads, "corruptions": stats.corruptions,
        "closed_fds": sample()["fds"], "flush": repr(flushed), "warnings": kept.messages,
    }))
