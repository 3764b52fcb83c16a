"""kill -9 during heavy writes, then recovery: every chunk served is exactly right."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier import KVStore
from tests.helpers.crash_writer import crash_config, sequence
from tests.helpers.kv import SMALL

ROOT = Path(__file__).resolve().parents[1]


def run_and_kill(path: Path, seed: int, rng: random.Random) -> int:
    """Start a writer, let it put at least a few sequences, SIGKILL it; return how many."""
    child = subprocess.Popen([sys.executable, "-m", "tests.helpers.crash_writer", str(path), str(seed)],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    done = 0
    deadline = time.monotonic() + 60
    target = rng.randint(3, 40)
    while done < target and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        done = int(line) + 1
    time.sleep(rng.random() * 0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    return done


def test_kill_9_during_writes_never_serves_a_wrong_byte(tmp_path):
    from tests.helpers.store import exact

    rng = random.Random(7)
    trials, served = 6, 0
    written: list[tuple[int, int]] = []
    for trial in range(trials):
        written.append((trial, run_and_kill(tmp_path, trial, rng) + 5))
        with KVStore(SMALL, crash_config(tmp_path)) as store:
            assert store.stats().recovered_chunks > 0
            for seed, count in written:
                for i in range(count):
                    for chunks in (1, 2, 3):
                        served += exact(store, sequence(seed, i, chunks))
            stats = store.stats()
            assert stats.io_errors == 0 and not stats.paths_down
    assert served > 0
