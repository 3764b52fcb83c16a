"""A store under heavy writes, to be killed with SIGKILL by tests/test_crash.py.

    python -m tests.crash_writer DIR SEED

Prints the number of each sequence it has put, one per line, flushed.
"""

import sys

import numpy as np

from kvtier import KVStore
from tests.conftest import SMALL, make_kv
from tests.test_crash import crash_config, sequence

if __name__ == "__main__":
    directory, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    with KVStore(SMALL, crash_config(directory)) as store:
        for i in range(1_000_000):
            tokens = sequence(seed, i, int(rng.integers(1, 4)))
            store.put(tokens, make_kv(tokens))
            print(i, flush=True)
