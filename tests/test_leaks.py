"""Opening, using and closing stores leaves no file descriptors or threads behind."""

import gc
import os
import threading
import time

from kvtier import KVStore
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, exact, seq


def open_fds() -> int:
    """Descriptors open now, at the quietest of a few looks: a store that another test left
    open still beats its lease and follows other writers from its threads, each opening a
    file for a moment; a leak stays."""
    counts = []
    for _ in range(10):
        counts.append(len(os.listdir("/proc/self/fd")))
        time.sleep(0.02)
    return min(counts)


def test_store_lifecycles_leak_no_fds_or_threads(tmp_path):
    def cycle(round_: int) -> None:
        with KVStore(SMALL, config(tmp_path, host_chunks=3, disk_chunks=12)) as store:
            for i in range(20):
                tokens = seq(round_ * 100_000 + i * 1000, 1 + i % 3)
                store.put(tokens, make_kv(tokens))
                exact(store, tokens)
            store.flush()
            stats = store.stats()
            assert stats.disk_writes > 0 and not stats.paths_down  # the disk tier was in use

    cycle(0)  # warm up: imports, first thread pools
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    for round_ in range(1, 6):
        cycle(round_)
    gc.collect()
    assert open_fds() == fds
    assert threading.active_count() == threads
