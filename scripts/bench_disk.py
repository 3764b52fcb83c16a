"""Disk tier throughput against fio and a naive one-file-per-chunk baseline, in one run.

    python scripts/bench_disk.py --dir ram=/mnt/kvtier-ram --dir root=/var/tmp/kvtier-bench
    python scripts/bench_disk.py --dir ram=/mnt/kvtier-ram --size 2GiB --chunks 2MiB,32MiB \\
        --depths 1,4,8,16 --compression --json out/bench_disk.json

`scripts/ramdisk.sh up` makes /mnt/kvtier-ram (a RAM-backed loop device with ext4). fio
comes from the distribution (`apt-get install fio`); without it the fio columns are empty.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtier.bench.disk import bench_directory, checksum_gib_s
from kvtier.units import format_size, parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", action="append", required=True, metavar="LABEL=PATH",
                        help="a directory to test, with a label (repeatable)")
    parser.add_argument("--size", default="2GiB", help="bytes per pass (default 2GiB)")
    parser.add_argument("--chunks", default="2MiB,32MiB", help="chunk sizes (default 2MiB,32MiB)")
    parser.add_argument("--depths", default="1,4,8,16", help="queue depths (default 1,4,8,16)")
    parser.add_argument("--batches", default="1,8",
                        help="chunks per vectored call: 1 = one chunk per I/O; more = a "
                             "request's neighbouring slots read together (default 1,8)")
    parser.add_argument("--buffered", action="store_true", help="also run without O_DIRECT")
    parser.add_argument("--compression", action="store_true", help="also run zstd (256 MiB)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    console = Console(width=max(Console().width, 132))
    results = []
    for spec in args.dir:
        label, _, path = spec.partition("=")
        directory = Path(path)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        results += bench_directory(
            label, directory, [parse_size(c) for c in args.chunks.split(",")],
            [int(d) for d in args.depths.split(",")], parse_size(args.size),
            batches=[int(b) for b in args.batches.split(",")],
            o_direct_modes=(True, False) if args.buffered else (True,),
            compression_size=256 * 2**20 if args.compression else 0,
            progress=lambda text: console.print(f"[dim]{text}[/dim]"))
    checksum = checksum_gib_s()

    table = Table(title=f"disk tier, {args.size} per pass (GiB/s; ratios measured in this run)")
    for column in ("dir", "chunk", "depth", "batch", "mode", "write", "read", "w/fio", "r/fio",
                   "w/naive", "r/naive", "aiofiles/kvtier", "verify cost", "stored"):
        table.add_column(column, justify="right")
    rows = [r.as_dict() for r in results]
    for row in rows:
        mode = ("zstd" if row["compression"] else "direct") if row["o_direct"] else "buffered"
        ratios = [f"{row[k]:.2f}" if k in row else "-" for k in
                  ("write_vs_fio", "read_vs_fio", "write_vs_naive", "read_vs_naive",
                   "aiofiles_vs_kvtier")]
        table.add_row(row["label"], format_size(row["chunk_bytes"]), str(row["depth"]),
                      str(row["batch"]), mode,
                      f"{row['write_gib_s']:.2f}", f"{row['read_gib_s']:.2f}", *ratios,
                      f"{row['verify_cost']:.0%}", f"{row['stored_ratio']:.2f}x")
    console.print(table)
    console.print(f"XXH3-64 on one core: {checksum:.1f} GiB/s. 'verify cost': read time added "
                  "by checking every payload, against the same reads unchecked.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": rows, "checksum_gib_s": checksum}, indent=2))


if __name__ == "__main__":
    main()
