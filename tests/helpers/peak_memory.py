"""The peak of what Python allocated while an offline command ran on a cache, measured in a
process of its own (``tracemalloc``, numpy's arrays included). In the test process, threads
and finalizers that other tests left behind allocate too, and ``tracemalloc`` counts every
thread: a peak measured there is not the command's alone.

With ``small_pieces`` the index is read, and write times are looked at, in pieces of 64
entries, so that a piece holds far fewer entries than the tests' caches do; without, as the
CLI reads them (``scripts/bench_offline_memory.py``).

    python tests/helpers/peak_memory.py COMMAND ROOT [--small-pieces]   (one line of JSON)

Run as a script, it imports kvtier from ``PYTHONPATH`` where that names another checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PIECE = 64  # index entries, write times, chosen slots and log records looked at a time
COMMANDS = ("inspect", "verify", "gc-dry", "gc")


def peak(command: str, root: Path, small_pieces: bool = True, timeout: float = 120) -> dict:
    """``command`` (one of ``COMMANDS``) run on the cache at ``root`` in a fresh process:
    ``{"peak": bytes, "seconds": ..., ...}`` with what the command found (``chunks``; for
    inspect the ``ages``' max and median, for verify the ``problems``)."""
    if command not in COMMANDS:
        raise ValueError(f"{command!r} is not one of {COMMANDS}")
    argv = [sys.executable, __file__, command, str(root)]
    done = subprocess.run(argv + (["--small-pieces"] if small_pieces else []), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{command} on {root} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _small_pieces() -> None:
    from kvtier.ops import segments, slot_freeing, victims
    from kvtier.segment import index_file

    index_file.INDEX_PIECE_ENTRIES = victims.BLOCK = PIECE
    slot_freeing.BLOCK = segments.LOG_BLOCK = PIECE


def _run(command: str, root: str, small_pieces: bool) -> dict:
    from kvtier.ops.cache import cache_root, namespaces
    from kvtier.ops.inspect import inspect_namespace
    from kvtier.ops.reclaim import gc
    from kvtier.ops.verify import verify_namespace

    if small_pieces:
        _small_pieces()
    dirs = namespaces(cache_root(root), None)
    tracemalloc.start()
    started = time.perf_counter()
    if command == "inspect":
        found = [inspect_namespace(d) for d in dirs]
        result = {"chunks": sum(n.chunks for n in found),
                  "ages": [(n.age_seconds["max"], n.age_seconds["median"]) for n in found]}
    elif command == "verify":
        checked = [verify_namespace(d) for d in dirs]
        result = {"chunks": sum(w.ok for n in checked for w in n.writers),
                  "problems": sum(n.problems for n in checked)}
    else:
        result = {"chunks": gc(dirs, target_bytes=0, dry_run=command == "gc-dry").chunks_freed}
    return {"peak": tracemalloc.get_traced_memory()[1],
            "seconds": time.perf_counter() - started, **result}


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], sys.argv[2], "--small-pieces" in sys.argv[3:])))
