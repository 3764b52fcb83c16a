"""A store under heavy writes, to be killed with SIGKILL by tests/test_crash.py.

    python -m tests.helpers.crash_writer DIR SEED

Prints the number of each sequence it has put, one per line, flushed. The test reopens the
store with the same config and checks the same sequences.
"""

import sys

import numpy as np

from kvtier import KVStore
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv


def crash_config(path):
    return {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES, "disk_paths": [str(path)],
            "disk_capacity": 96 * (4096 + CHUNK_BYTES), "disk_min_free": 0, "io_threads": 4,
            "model": "test-model"}


def sequence(seed: int, i: int, chunks: int) -> list[int]:
    start = seed * 10_000_000 + i * 1000
    return list(range(start, start + chunks * CHUNK))


if __name__ == "__main__":
    directory, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    with KVStore(SMALL, crash_config(directory)) as store:
        for i in range(1_000_000):
            tokens = sequence(seed, i, int(rng.integers(1, 4)))
            store.put(tokens, make_kv(tokens))
            print(i, flush=True)
