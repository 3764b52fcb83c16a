"""The naive baseline the disk benchmark compares against."""

import os

import numpy as np

from kvtier.bench import naive
from kvtier.bench.naive import naive_round_trip


def test_naive_baseline_is_the_best_of_its_passes_and_cleans_up(tmp_path, monkeypatch):
    syncs, sync = [], os.sync
    monkeypatch.setattr(naive.os, "sync", lambda: syncs.append(1) or sync())
    chunks = [np.full(64 * 1024, i, dtype=np.uint8) for i in range(8)]
    write, read = naive_round_trip(tmp_path / "naive", chunks, passes=3)
    assert write > 0 and read > 0
    assert len(syncs) == 3  # every pass writes through to the device
    assert list((tmp_path / "naive").iterdir()) == []
