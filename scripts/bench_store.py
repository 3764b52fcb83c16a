"""``KVStore`` as a user calls it, against fio and ``numpy.copyto`` on the same machine, in one run.

    scripts/ramdisk.sh up /mnt/kvtier-ram 8G
    .venv/bin/python scripts/bench_store.py --dir /mnt/kvtier-ram --chunks 1MiB,2MiB,32MiB \\
        --json out/bench_store.json

For each chunk size: ``put`` 2 GiB of prefixes (``--prefix-tokens`` each, 2048 by default:
256 MiB of Llama-3-8B's KV) into a store with 512 MiB of host memory and its disk on
``--dir``, then ``flush()`` (put + flush); close, open a new store on the same directory, page
cache dropped, and ``get`` every prefix into the caller's tensor, reused from get to get as a
serving engine reuses its buffers (every byte checked): into a tensor from ``store.empty_kv``
(disk chunks read straight into it; "cores" is how many of the machine's cores were busy
meanwhile, "CPU" this process's CPU seconds per GiB), then after another restart the same
with payload checksums off (what verifying costs), then after a third into a plain torch
tensor (read through host slots). Then, each after a restart, gets as a user writes them,
into a new tensor each: a ``torch.empty`` of the prefix's shape (its pages faulted in by the
get: ``kvtier/io/populate.py``), the same with that populating turned off (the store before
it: each page faulted in by the copy into it), and a new ``store.empty_kv`` each (its time
counted: it faults its pages in when made). Against fio's best read and write on the same
directory with I/Os of the chunk's size (the best of libaio and io_uring, 1, 2 and 4 jobs,
depths 1 to 32: ``kvtier/bench/fio_grid.py``), and against the floor for any Python reader
here (the same reads with nothing else: ``kvtier/bench/bare_reads.py``). Host only: the
same prefixes put and got with every chunk in host memory, against ``numpy.copyto`` of the
same bytes into and out of memory the size of the store's host slots. Best of ``--passes``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

import kvtier.store.kvstore as kvstore_module
from kvtier import KVLayout, KVStore
from kvtier.bench.bare_reads import bare_read_bandwidth
from kvtier.bench.busy import Busy
from kvtier.bench.fio import have_fio
from kvtier.bench.fio_grid import FioBest, fio_grid_best
from kvtier.bench.naive import drop_page_cache
from kvtier.config.values import parse_size
from kvtier.store.chunk_runs import ChunkRuns, slot_rows

LAYOUT = KVLayout(num_layers=32, kv_heads=8, head_size=128, dtype="bfloat16")
PREFIX_TOKENS = 2048  # a prompt's cached prefix: 256 MiB of this layout's KV
FRESH_KINDS = ("torch", "unpopulated", "empty_kv")  # a new tensor each get: see the docstring


class Workload:
    """``count`` prefixes of ``prefix_tokens`` tokens (whole chunks, at least one), each its
    own tokens, one KV tensor (the bytes are the same for every prefix; the keys are not)."""

    def __init__(self, chunk_bytes: int, total: int, prefix_tokens: int = PREFIX_TOKENS) -> None:
        self.chunk_tokens = chunk_bytes // LAYOUT.token_bytes
        self.prefix_tokens = max(1, prefix_tokens // self.chunk_tokens) * self.chunk_tokens
        self.count = max(1, total // (self.prefix_tokens * LAYOUT.token_bytes))
        self.bytes = self.count * self.prefix_tokens * LAYOUT.token_bytes
        self.kv = torch.randn(LAYOUT.shape(self.prefix_tokens)).to(torch.bfloat16)
        self.out = torch.zeros_like(self.kv)  # touched once: no page faults in the timing

    def tokens(self, i: int) -> list[int]:
        return list(range(i * self.prefix_tokens, (i + 1) * self.prefix_tokens))

    def config(self, host: int, disk: Path | None) -> dict:
        cfg: dict[str, object] = {"chunk_tokens": self.chunk_tokens, "host_capacity": host,
                                  "disk_min_free": 0}
        if disk is not None:
            cfg.update(disk_paths=[str(disk)], disk_capacity=int(self.bytes * 1.3) + 2**30)
        return cfg


def put_all(store: KVStore, work: Workload) -> float:
    start = time.perf_counter()
    for i in range(work.count):
        store.put(work.tokens(i), work.kv)
    return time.perf_counter() - start


def get_all(store: KVStore, work: Workload, out: torch.Tensor | None = None) -> tuple[float, float]:
    """Seconds in ``get`` over every prefix, and this process's CPU seconds meanwhile (each
    prefix checked between the gets, untimed)."""
    out = work.out if out is None else out
    seconds = cpu = 0.0
    for i in range(work.count):
        start, before = time.perf_counter(), time.process_time()
        got = store.get(work.tokens(i), out)
        seconds += time.perf_counter() - start
        cpu += time.process_time() - before
        assert got == work.prefix_tokens, f"prefix {i}: {got} of {work.prefix_tokens} tokens"
        assert torch.equal(out.view(torch.int16), work.kv.view(torch.int16)), "wrong bytes"
        out.view(torch.int16).fill_(0)  # the next get must fill it again
    return seconds, cpu


def get_after_restart(work: Workload, cfg: dict, direct: bool,
                      verify: bool = True) -> tuple[float, float, float]:
    """GiB/s of getting every prefix from a new store on the same directory (page cache
    dropped), the cores busy meanwhile, and this process's CPU seconds per GiB."""
    drop_page_cache()
    with KVStore(LAYOUT, cfg, model="bench") as store:
        out = store.empty_kv(work.prefix_tokens) if direct else None
        if store.disk is not None:
            store.disk.verify_payload = verify
        with Busy() as busy:
            seconds, cpu = get_all(store, work, out)
    return work.bytes / 2**30 / seconds, busy.cores, cpu / (work.bytes / 2**30)


def disk_pass(work: Workload, root: Path) -> tuple[float, ...]:
    """GiB/s of put + flush; of get after a restart into a tensor from ``empty_kv``, the
    cores busy and CPU per GiB meanwhile; the same unverified; and get into a plain torch
    tensor."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = work.config(512 * 2**20, root)
    with KVStore(LAYOUT, cfg, model="bench") as store:
        start = time.perf_counter()
        put_all(store, work)
        flushed = store.flush()
        put_s = time.perf_counter() - start
        assert flushed, flushed
    get, cores, cpu = get_after_restart(work, cfg, direct=True)
    unverified, _, _ = get_after_restart(work, cfg, direct=True, verify=False)
    plain, _, _ = get_after_restart(work, cfg, direct=False)
    fresh = [get_fresh_after_restart(work, cfg, kind) for kind in FRESH_KINDS]
    return work.bytes / 2**30 / put_s, get, cores, cpu, unverified, plain, *fresh


@contextmanager
def unpopulated() -> Iterator[None]:
    """``KVStore.get`` as before it populated its destination: each page faulted in by the
    copy into it."""
    populating = kvstore_module.populating
    kvstore_module.populating = lambda chunks: chunks
    try:
        yield
    finally:
        kvstore_module.populating = populating


def get_fresh_after_restart(work: Workload, cfg: dict, kind: str) -> float:
    """GiB/s of getting every prefix from a new store (page cache dropped) into a new tensor
    each, as a user writes it: ``torch.empty`` (``unpopulated``: with the get's populating
    off), or ``store.empty_kv`` (made within the time: it faults its pages in)."""
    drop_page_cache()
    shape = LAYOUT.shape(work.prefix_tokens)
    with KVStore(LAYOUT, cfg, model="bench") as store:
        new: Callable[[], torch.Tensor] = (
            (lambda: store.empty_kv(work.prefix_tokens)) if kind == "empty_kv"
            else (lambda: torch.empty(shape, dtype=work.kv.dtype)))
        seconds = 0.0
        with unpopulated() if kind == "unpopulated" else nullcontext():
            for i in range(work.count):
                start = time.perf_counter()
                out = new()
                got = store.get(work.tokens(i), out)
                seconds += time.perf_counter() - start
                assert got == work.prefix_tokens, f"prefix {i}: {got} of {work.prefix_tokens} tokens"
                assert torch.equal(out.view(torch.int16), work.kv.view(torch.int16)), "wrong bytes"
                del out  # freed outside the time
    return work.bytes / 2**30 / seconds


def host_pass(work: Workload) -> tuple[float, ...]:
    """GiB/s of host-only put and get; of ``numpy.copyto`` of the same bytes into and out of
    memory the size of the store's host slots (not a cache-resident copy), contiguous; and of
    ``numpy.copyto`` between the caller's tensor and those slots laid out as the store's
    (each chunk a slot, scattered over the tensor's rows), a prefix a copy: the floor for
    any copy that does a host put's or get's job with this layout."""
    cfg = work.config(work.bytes + 2**30, None)
    with KVStore(LAYOUT, cfg, model="bench") as store:
        put_all(store, work)  # the first pass faults the host slots in
    with KVStore(LAYOUT, cfg, model="bench") as store:
        put_s = put_all(store, work)
        get_s, _ = get_all(store, work)
    src = work.kv.view(torch.uint8).numpy().reshape(-1)
    out = work.out.view(torch.uint8).numpy().reshape(-1)
    pool = np.ones((work.count, src.size), dtype=np.uint8)  # touched: faulted in
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(pool[i], src)
    copy_in_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(out, pool[i])
    copy_out_s = time.perf_counter() - start
    per_prefix = work.prefix_tokens // work.chunk_tokens
    slots = slot_rows(pool.reshape(-1), work.count * per_prefix, src.size // per_prefix,
                      src.size // per_prefix, work.kv.element_size(),
                      LAYOUT.shape(work.chunk_tokens))
    caller_in = ChunkRuns(work.kv, work.chunk_tokens, per_prefix).run(0, per_prefix)
    caller_out = ChunkRuns(work.out, work.chunk_tokens, per_prefix, into=True).run(0, per_prefix)
    assert isinstance(caller_in, np.ndarray) and isinstance(caller_out, np.ndarray), "CPU tensors"
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(slots[i * per_prefix:(i + 1) * per_prefix], caller_in)
    scatter_in_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(caller_out, slots[i * per_prefix:(i + 1) * per_prefix])
    scatter_out_s = time.perf_counter() - start
    gib = work.bytes / 2**30
    return (gib / put_s, gib / get_s, gib / copy_in_s, gib / copy_out_s, gib / scatter_in_s,
            gib / scatter_out_s)


def fio_best(directory: Path, chunk_bytes: int, total: int,
             seconds: float = 0.5) -> tuple[FioBest | None, FioBest | None]:
    """fio's best write and read over engines, jobs and depths (``fio_grid_best``), each
    with its shape and the cores busy meanwhile."""
    if not have_fio():
        return None, None
    size = min(total, 2**30)
    write = fio_grid_best(directory, "write", chunk_bytes, size, seconds=seconds)
    read = fio_grid_best(directory, "read", chunk_bytes, size, seconds=seconds)
    return write, read


def measure(directory: Path, chunk_bytes: int, total: int, passes: int, prefix_tokens: int,
            fio_seconds: float = 0.5) -> dict:
    work = Workload(chunk_bytes, total, prefix_tokens)
    root = directory / "kvtier-bench-store"
    best = dict.fromkeys(["put_flush", "get", "get_cores", "get_cpu_per_gib", "get_unverified",
                          "get_plain", *(f"get_fresh_{kind}" for kind in FRESH_KINDS),
                          "host_put", "host_get", "copyto_in", "copyto_out",
                          "scatter_in", "scatter_out"], 0.0)
    during_best_get = ("get_cores", "get_cpu_per_gib")
    try:
        for _ in range(passes):
            figures = dict(zip(best, (*disk_pass(work, root), *host_pass(work)), strict=True))
            if figures["get"] > best["get"]:  # the cores busy during the best get
                best.update({name: figures[name] for name in during_best_get})
            for name, value in figures.items():
                if name not in during_best_get:
                    best[name] = max(best[name], value)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fio_w, fio_r = fio_best(directory, chunk_bytes, work.bytes, fio_seconds)
    fio_write, fio_read = (fio_w.gib_s if fio_w else None), (fio_r.gib_s if fio_r else None)
    bare = max(bare_read_bandwidth(directory, chunk_bytes, work.bytes, rows=2 * LAYOUT.num_layers,
                                   prefix_bytes=work.prefix_tokens * LAYOUT.token_bytes)
               for _ in range(passes))
    row: dict = {"chunk_bytes": chunk_bytes, "bytes": work.bytes, "prefix_tokens": work.prefix_tokens, **best,
                 "fio_write": fio_write, "fio_read": fio_read,
                 "fio_write_cores": fio_w.cores if fio_w else None,
                 "fio_read_cores": fio_r.cores if fio_r else None,
                 "fio_write_shape": str(fio_w.shape) if fio_w else None,
                 "fio_read_shape": str(fio_r.shape) if fio_r else None, "bare_read": bare.gib_s,
                 "bare_cpu_per_gib": bare.cpu_per_gib, "get_vs_bare": best["get"] / bare.gib_s}
    if fio_write and fio_read:
        row["put_flush_vs_fio"], row["get_vs_fio"] = best["put_flush"] / fio_write, best["get"] / fio_read
        row["get_plain_vs_fio"] = best["get_plain"] / fio_read
        row["get_unverified_vs_fio"] = best["get_unverified"] / fio_read
        row["bare_read_vs_fio"] = bare.gib_s / fio_read
        for kind in FRESH_KINDS:
            row[f"get_fresh_{kind}_vs_fio"] = best[f"get_fresh_{kind}"] / fio_read
    row["get_fresh_torch_vs_reused"] = best["get_fresh_torch"] / best["get_plain"]
    row["get_fresh_unpopulated_vs_reused"] = best["get_fresh_unpopulated"] / best["get_plain"]
    row["get_fresh_torch_vs_unpopulated"] = best["get_fresh_torch"] / best["get_fresh_unpopulated"]
    row["host_put_vs_copyto"] = best["host_put"] / best["copyto_in"]
    row["host_get_vs_copyto"] = best["host_get"] / best["copyto_out"]
    row["host_put_vs_scatter"] = best["host_put"] / best["scatter_in"]
    row["host_get_vs_scatter"] = best["host_get"] / best["scatter_out"]
    return row


def print_table(rows: list[dict]) -> None:
    def ratio(r: dict, name: str) -> str:
        return f"{r[name]:.2f}" if name in r else "-"

    print("| chunk | put+flush GiB/s | fio write | put+flush/fio | get GiB/s | cores | fio read "
          "| fio's cores | get/fio | unverified/fio | plain tensor/fio | bare Python read/fio | get/bare "
          "| CPU s/GiB get, bare | host put/copyto | host get/copyto | host put/scatter "
          "| host get/scatter |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk_bytes'] >> 20} MiB | {r['put_flush']:.2f} | {r['fio_write'] or 0:.2f} | "
              f"{ratio(r, 'put_flush_vs_fio')} | {r['get']:.2f} | {r['get_cores']:.1f} | "
              f"{r['fio_read'] or 0:.2f} | {r['fio_read_cores'] or 0:.1f} | {ratio(r, 'get_vs_fio')} | "
              f"{ratio(r, 'get_unverified_vs_fio')} | "
              f"{ratio(r, 'get_plain_vs_fio')} | {ratio(r, 'bare_read_vs_fio')} | "
              f"{r['get_vs_bare']:.2f} | {r['get_cpu_per_gib']:.2f}, {r['bare_cpu_per_gib']:.2f} | "
              f"{r['host_put_vs_copyto']:.2f} | "
              f"{r['host_get_vs_copyto']:.2f} | {r['host_put_vs_scatter']:.2f} | "
              f"{r['host_get_vs_scatter']:.2f} |")


def print_fresh_table(rows: list[dict]) -> None:
    """Gets into a new tensor each (what a user writes) against fio's best and the reused
    plain tensor."""
    def ratio(r: dict, name: str) -> str:
        return f"{r[name]:.2f}" if name in r else "-"

    print("\n| chunk | fio read (shape) | fio write (shape) | put+flush/fio | reused empty_kv/fio "
          "| reused torch/fio | new torch.empty/fio | new torch.empty, not populated/fio "
          "| new empty_kv/fio | new/reused torch | new/reused, not populated | populated/not |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk_bytes'] >> 20} MiB | {r['fio_read'] or 0:.2f} ({r['fio_read_shape']}) "
              f"| {r['fio_write'] or 0:.2f} ({r['fio_write_shape']}) | {ratio(r, 'put_flush_vs_fio')} "
              f"| {ratio(r, 'get_vs_fio')} | {ratio(r, 'get_plain_vs_fio')} "
              f"| {ratio(r, 'get_fresh_torch_vs_fio')} | {ratio(r, 'get_fresh_unpopulated_vs_fio')} "
              f"| {ratio(r, 'get_fresh_empty_kv_vs_fio')} | {r['get_fresh_torch_vs_reused']:.2f} "
              f"| {r['get_fresh_unpopulated_vs_reused']:.2f} | {r['get_fresh_torch_vs_unpopulated']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the device")
    parser.add_argument("--chunks", default="1MiB,2MiB,32MiB")
    parser.add_argument("--size", default="2GiB", help="bytes put per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS,
                        help="tokens per prefix, rounded down to whole chunks (at least one)")
    parser.add_argument("--fio-seconds", type=float, default=0.5,
                        help="seconds fio runs each shape (engine, jobs, depth)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    total = parse_size(args.size)
    rows = []
    for chunk in args.chunks.split(","):
        rows.append(measure(args.dir, parse_size(chunk), total, args.passes, args.prefix_tokens,
                            args.fio_seconds))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    print_fresh_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
