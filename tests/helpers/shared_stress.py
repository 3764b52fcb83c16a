"""One process of tests/test_shared_stress.py: a writer and reader of a shared directory.

    python -m tests.helpers.shared_stress DIR NAME SEED STOP_FILE OUT.json

It opens a KVStore under instance_id NAME on DIR (one of WRITERS segments of a few chunks
each) and runs THREADS threads that each put and get prefixes of one family at random, from
its own tiers and from the other writers' segments, while those overwrite their slots, and
checks every byte a get serves. It stops when STOP_FILE appears (or after MAX_SECONDS), and
writes its counts and stats to OUT.json; it is also killed with kill -9 and restarted.
"""

import json
import random
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from kvtier import KVStore
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv

WRITERS = 3  # share_writers: one seat each, so a restarted writer must get its own back
THREADS = 3
SLOTS = 6  # disk slots per writer, under the 34 chunks of the family
BRANCHES = 12
MAX_CHUNKS = 5
MAX_SECONDS = 90.0
STRIDE = 4096 + CHUNK_BYTES  # a disk slot: header page and payload
KEYS = ("puts", "flushes", "gets", "hits", "hit_tokens", "wrong_gets", "wrong_bytes",
        "bad_lengths")


def family(branch: int, chunks: int) -> list[int]:
    """A prefix of ``chunks`` chunks: chunk 0 is shared by every branch, chunk 1 by four,
    chunk 2 by two, chunks 3 and 4 by none (1 + 3 + 6 + 12 + 12 = 34 distinct chunks)."""
    owners = (0, branch // 4, branch // 2, branch, branch)
    tokens: list[int] = []
    for j in range(chunks):
        start = (j * 100 + owners[j]) * CHUNK
        tokens += range(start, start + CHUNK)
    return tokens


def store_config(directory: str, name: str) -> dict:
    return {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES, "disk_paths": [directory],
            "disk_capacity": WRITERS * SLOTS * STRIDE, "disk_min_free": 0, "io_threads": 2,
            "model": "stress", "instance_id": name, "share_refresh": "20ms",
            "share_writers": WRITERS, "lease_timeout": "60s", "write_policy": "write_through"}


def wrong_bytes(got: torch.Tensor, expected: torch.Tensor) -> int:
    a, b = got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
    return int((a != b).sum())


def work(store: KVStore, rng: random.Random, expected: dict, stop: threading.Event,
         results: list, errors: list) -> None:
    counts = dict.fromkeys(KEYS, 0)
    results.append(counts)  # read as it grows: its keys are all there
    buffer = torch.zeros(SMALL.shape(MAX_CHUNKS * CHUNK), dtype=torch.bfloat16)
    try:
        while not stop.is_set():  # the main thread sets it within MAX_SECONDS
            tokens, kv = expected[rng.randrange(BRANCHES), rng.randint(1, MAX_CHUNKS)]
            roll = rng.random()
            if roll < 0.35:
                store.put(tokens, kv)
                counts["puts"] += 1
            elif roll < 0.37:
                store.flush(timeout=10)
                counts["flushes"] += 1
            else:
                buffer.zero_()
                n = store.get(tokens, buffer)
                counts["gets"] += 1
                counts["hits"] += int(n > 0)
                counts["hit_tokens"] += n
                if n % CHUNK or n > len(tokens):
                    counts["bad_lengths"] += 1
                    print(f"WRONG: {n} tokens served of {len(tokens)}", flush=True)
                    continue
                bad = wrong_bytes(buffer[:, :, :n], kv[:, :, :n])
                counts["wrong_bytes"] += bad
                if bad:
                    counts["wrong_gets"] += 1
                    print(f"WRONG: {bad} bytes of {n} tokens of {len(tokens)}", flush=True)
    except BaseException:
        errors.append(traceback.format_exc())


def total(results: list[dict]) -> dict:
    return {key: sum(counts[key] for counts in results) for key in KEYS}


def main(directory: str, name: str, seed: int, stop_file: str, out: str) -> int:
    torch.set_num_threads(1)
    expected = {(b, c): (tokens, make_kv(tokens)) for b in range(BRANCHES)
                for c in range(1, MAX_CHUNKS + 1) for tokens in [family(b, c)]}
    store = KVStore(SMALL, store_config(directory, name))
    recovered = store.stats().recovered_chunks
    print("ready", flush=True)
    stop, results, errors = threading.Event(), [], []
    threads = [threading.Thread(target=work, daemon=True, args=(
        store, random.Random(seed * 100 + i), expected, stop, results, errors))
        for i in range(THREADS)]
    for thread in threads:
        thread.start()
    end = time.monotonic() + MAX_SECONDS
    while not Path(stop_file).exists() and time.monotonic() < end:
        time.sleep(0.25)  # the counts so far, for an incarnation that is killed
        print("counts", json.dumps(total(results)), flush=True)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    hung = sum(thread.is_alive() for thread in threads)
    stats = store.stats()
    closed = not hung and store.close(timeout=20)
    counts = total(results)
    Path(out).write_text(json.dumps({
        "counts": counts, "errors": errors, "hung_threads": hung, "closed": closed,
        "recovered_chunks": recovered, "paths_down": stats.paths_down,
        "shared_reads": stats.shared_reads, "shared_failures": stats.shared_failures,
        "shared_writers": stats.shared_writers, "corruptions": stats.corruptions,
        "torn_slots": stats.torn_slots, "io_errors": stats.io_errors,
        "load_timeouts": stats.load_timeouts, "disk_writes": stats.disk_writes,
        "chunks_loaded": {str(k): v for k, v in stats.chunks_loaded.items()}}))
    return 0 if closed and not errors else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]))
