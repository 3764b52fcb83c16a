"""Memory the offline commands take on a cache of N chunks (20,000 and 100,000).

    python scripts/bench_offline_memory.py [--chunks 20000,100000] [--dir DIR] [--json out.json]

A cache of N chunks (the tests' small layout: 4 KiB chunks, one writer) is written through a
``KVStore`` under DIR (a temporary directory by default), then ``inspect``, ``verify`` and
``gc`` (a dry run freeing every chunk: ``--target 0``) run on it, each in a process of its
own, as the CLI calls them (``kvtier.ops``); then ``gc-free``, the same ``gc`` run for
real (every slot checked against the index, the log started afresh, the space punched
out). Each reports the peak of what Python allocated while it ran (``tracemalloc``, numpy's
arrays included), its time, and the peak's growth per chunk from the smallest cache to
each larger one (fixed costs, such as the MiB of index read at a time, cancel out). Run
with ``PYTHONPATH`` at another checkout to measure that one's commands the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("inspect", "verify", "gc", "gc-free")  # gc-free last: it empties the cache
HELPER_NAMES = {"inspect": "inspect", "verify": "verify", "gc": "gc-dry", "gc-free": "gc"}
PUT_CHUNKS = 512

def build(root: Path, chunks: int) -> None:
    sys.path.insert(0, str(ROOT))
    from kvtier import KVStore
    from tests.helpers.kv import CHUNK, SMALL, make_kv
    from tests.helpers.store import config

    root.mkdir(mode=0o700)
    with KVStore(SMALL, config(root, host_chunks=PUT_CHUNKS, disk_chunks=chunks + 8)) as store:
        for first in range(0, chunks, PUT_CHUNKS):
            count = min(PUT_CHUNKS, chunks - first)
            tokens = list(range(10**7 + first * CHUNK, 10**7 + (first + count) * CHUNK))
            store.put(tokens, make_kv(tokens))
            if not store.flush():
                raise SystemExit("the cache could not be written: its disk is full or failing")


def measure(command: str, root: Path) -> dict:
    """``command`` run on the cache at ``root`` in a process of its own, reading as the CLI
    does (``tests/helpers/peak_memory.py``)."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.peak_memory import peak

    found = peak(HELPER_NAMES[command], root, small_pieces=False, timeout=3600)
    return {key: found[key] for key in ("chunks", "peak", "seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="20000,100000")
    parser.add_argument("--dir", default=None, help="where the caches are written")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.chunks.split(","))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for chunks in sizes:
            build(Path(where) / str(chunks), chunks)
            for command in COMMANDS:
                rows.append({"command": command, "cache_chunks": chunks,
                             **measure(command, Path(where) / str(chunks))})
    first = {row["command"]: row for row in rows if row["cache_chunks"] == sizes[0]}
    print("| command | chunks | peak MB | seconds | bytes a chunk more |")
    print("|---|---|---|---|---|")
    for row in rows:
        base = first[row["command"]]
        more = row["cache_chunks"] - base["cache_chunks"]
        row["bytes_a_chunk_more"] = (row["peak"] - base["peak"]) / more if more else None
        grown = f"{row['bytes_a_chunk_more']:.0f}" if more else "-"
        print(f"| {row['command']} | {row['chunks']} | {row['peak'] / 1e6:.1f} | "
              f"{row['seconds']:.2f} | {grown} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
