"""What one reader (``SharedView``) pays for a co-writer's segment that is large or hostile:
the bounds docs/shared.md states, measured.

    .venv/bin/python scripts/bench_share_bounds.py [--holders 100000] [--chunks 400000] \
        [--dir /tmp] [--json out/bench_share_bounds.json]

Each case writes one co-writer's ``log.kvt`` (through ``SegmentLog``, as a writer does) under
a scratch directory, then times the reader's refreshes:

- ``holders``: the log names ``--holders`` slots that all repeat one valid entry, then the
  co-writer starts a new log (as every restart does): the refresh that forgets them all.
- ``memory``: the log names ``--chunks`` distinct valid chunks: the reader's memory per chunk
  followed (``tracemalloc``, after the refresh, less before).
- ``first``: the log names ``--chunks`` distinct valid chunks: a new reader's first refresh
  (what opening a store or an engine runs), and the refreshes it takes to see them all.
- ``zeros``: a log of 64 GiB (its header, a few records, then zeros, a sparse file): the bytes
  each refresh reads.
- ``appender``: a co-writer process appending valid records as fast as it can: the longest
  refresh among those run while it appends, and the records each one read.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvtier.io.format import INDEX_ENTRY_BYTES, Codec, SlotHeader
from kvtier.io.safefs import SafeDir
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.log import RECORD_BYTES, entries_of
from kvtier.segment.log_writer import SegmentLog
from kvtier.segment.names import LOG_FILE, WRITERS_DIR
from kvtier.shared.view import SharedView

RAW = 4096
NS = Namespace(model="bench/bounds", kv_dtype="bfloat16", layout="LKTH", block_tokens=16,
               chunk_tokens=16)


def entry(n: int) -> bytes:
    header = SlotHeader(NS.digest(), ChunkKey(n.to_bytes(16, "little")), Codec.NONE, RAW, RAW,
                        n + 1, n + 1, 0)
    return header.encode()[:INDEX_ENTRY_BYTES]


def segment(root: Path, writer: str) -> SafeDir:
    with SafeDir.open(root) as top, top.subdir(NS.id, create=True) as ns_dir, \
            ns_dir.subdir(WRITERS_DIR, create=True) as writers:
        return writers.subdir(writer, create=True)


def write_log(directory: SafeDir, pairs: list[tuple[int, bytes]]) -> SegmentLog:
    """A new log (a new file, a new epoch) naming ``pairs`` (local slot, entry)."""
    return SegmentLog(directory, NS.digest(), lambda: entries_of(pairs), 1 << 40)


def view_of(root: Path) -> SharedView:
    return SharedView([str(root)], NS, RAW, ("reader",), 120.0)


def catch_up(view: SharedView) -> int:
    """Refresh ``view`` until it has read every log whole; the refreshes it took."""
    refreshes = 0
    while True:  # one refresh reads at most REFRESH_BYTES of log a path
        read = view.bytes_read
        view.refresh()
        refreshes += 1
        if view.bytes_read == read:
            return refreshes


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def holders(root: Path, n: int) -> dict:
    one = entry(0)
    with segment(root, "w-holders") as directory:
        write_log(directory, [(s, one) for s in range(n)]).close()
        view = view_of(root)
        first = timed(lambda: catch_up(view))
        assert view.writers()[0].chunks == n
        write_log(directory, []).close()  # the co-writer restarted: a new, empty log
        forget = timed(view.refresh)
        view.close()
    return {"holders": n, "catch_up_s": first, "restart_refresh_s": forget}


def memory(root: Path, n: int) -> dict:
    with segment(root, "w-memory") as directory:
        write_log(directory, [(s, entry(s)) for s in range(n)]).close()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view = view_of(root)
    catch_up(view)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(view) == n, len(view)
    view.close()
    return {"chunks": n, "bytes_per_chunk": (after - before) / n}


def first_refresh(root: Path, n: int) -> dict:
    """A reader made next to a co-writer of ``n`` chunks: its first refresh (what a new store
    or engine runs as it opens), then the refreshes it takes to see them all."""
    with segment(root, "w-first") as directory:
        write_log(directory, [(s, entry(s)) for s in range(n)]).close()
    view = view_of(root)
    started = time.perf_counter()
    view.refresh()
    first_s, seen = time.perf_counter() - started, len(view)
    started = time.perf_counter()
    more = catch_up(view)
    rest_s = time.perf_counter() - started
    view.close()
    return {"chunks": n, "first_refresh_s": first_s, "chunks_after_first": seen,
            "refreshes_to_all": 1 + more, "catch_up_s": rest_s}


def zeros(root: Path, refreshes: int = 20) -> dict:
    with segment(root, "w-zeros") as directory:
        write_log(directory, [(s, entry(s)) for s in range(10)]).close()
    os.truncate(root / NS.id / WRITERS_DIR / "w-zeros" / LOG_FILE, 64 << 30)
    view = view_of(root)
    read = []
    for _ in range(refreshes):
        before = view.bytes_read
        view.refresh()
        read.append(view.bytes_read - before)
    view.close()
    return {"log_bytes": 64 << 30, "bytes_read_by_refresh": read}


def _append(root: str, stop) -> None:
    with segment(Path(root), "w-append") as directory:
        log = write_log(directory, [])
        n = 0
        while not stop.is_set():
            log.append(n % 4096, entry(n))
            n += 1
        log.close()


def appender(root: Path, seconds: float) -> dict:
    stop = multiprocessing.Event()
    writer = multiprocessing.Process(target=_append, args=(str(root), stop))
    writer.start()
    time.sleep(1.0)
    view = view_of(root)
    longest, records = 0.0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = view.bytes_read
        longest = max(longest, timed(view.refresh))
        records.append((view.bytes_read - before) // RECORD_BYTES)
    stop.set()
    writer.join()
    view.close()
    return {"refreshes": len(records), "longest_refresh_s": longest,
            "most_records_a_refresh": max(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holders", type=int, default=100_000)
    parser.add_argument("--chunks", type=int, default=400_000)
    parser.add_argument("--append-seconds", type=float, default=10.0)
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where to make the run's scratch directories (removed at the end)")
    parser.add_argument("--cases", help="comma-separated cases to run (default: all)")
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = {"holders": lambda root: holders(root, args.holders),
             "memory": lambda root: memory(root, args.chunks),
             "first": lambda root: first_refresh(root, args.chunks),
             "zeros": zeros,
             "appender": lambda root: appender(root, args.append_seconds)}
    wanted = args.cases.split(",") if args.cases else list(cases)
    result = {}
    for name, case in ((name, cases[name]) for name in wanted):
        root = Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-", dir=args.dir))  # ours alone
        try:
            result[name] = case(root)
        finally:
            shutil.rmtree(root)
        print(name, json.dumps(result[name]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
