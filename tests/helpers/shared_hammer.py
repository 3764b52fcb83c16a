"""One process of tests/test_shared_hammer.py: a writer or a reader on a shared directory.

    python -m tests.helpers.shared_hammer writer DIR NAME SEED
    python -m tests.helpers.shared_hammer reader DIR NAME SEED SECONDS OUT.json

The writer puts prefixes of one family over and over into a disk tier of a few chunks, so
its slots are overwritten all the time, until it is killed. A reader gets prefixes of the
same family for SECONDS, from the writer's segment, and checks every byte it is given; it
writes what it saw to OUT.json.
"""

import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from kvtier import KVStore
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv, same_bytes

PREFIXES = 12  # prefixes in the family, 3 chunks each: 36 chunks over a disk of 8


def family(index: int) -> list[int]:
    return list(range(index * 1000, index * 1000 + 3 * CHUNK))


def store_config(directory: str, name: str, **extra) -> dict:
    return {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES, "disk_paths": [directory],
            "disk_capacity": 8 * (4096 + CHUNK_BYTES), "disk_min_free": 0, "io_threads": 2,
            "model": "hammer", "instance_id": name, "share_refresh": "20ms", **extra}


def write_forever(directory: str, name: str, seed: int) -> None:
    rng = random.Random(seed)
    store = KVStore(SMALL, store_config(directory, name, write_policy="write_through"))
    print("ready", flush=True)
    while True:
        tokens = family(rng.randrange(PREFIXES))
        store.put(tokens, make_kv(tokens))
        if rng.random() < 0.3:
            store.flush()


def read_for(directory: str, name: str, seed: int, seconds: float, out: str) -> None:
    rng = random.Random(seed)
    counts: Counter = Counter()
    with KVStore(SMALL, store_config(directory, name, host_capacity=CHUNK_BYTES)) as store:
        buffer = torch.zeros(SMALL.shape(3 * CHUNK), dtype=torch.bfloat16)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tokens = family(rng.randrange(PREFIXES))
            n = store.get(tokens, buffer)
            counts["gets"] += 1
            counts["hit_tokens"] += n
            if n and not same_bytes(buffer[:, :, :n], make_kv(tokens)[:, :, :n]):
                counts["wrong_bytes_served"] += 1
        stats = store.stats()
    Path(out).write_text(json.dumps({"counts": counts, "shared_reads": stats.shared_reads,
                                     "shared_failures": stats.shared_failures}))


if __name__ == "__main__":
    role, directory, name, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if role == "writer":
        write_forever(directory, name, seed)
    else:
        read_for(directory, name, seed, float(sys.argv[5]), sys.argv[6])
