"""Render scripts/bench_disk.py's JSON as a Markdown table (for docs/benchmarks.md).

    python scripts/bench_table.py out/bench_disk.json
"""

from __future__ import annotations

import json
import sys


def cell(row: dict, key: str, digits: int = 2) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print("| dir | chunk | depth | batch | mode | write GiB/s | read GiB/s | write/fio | read/fio "
          "| write/naive | read/naive | aiofiles/kvtier | verify cost |")
    print("|" + "---|" * 13)
    for row in data["results"]:
        mode = ("zstd" if row["compression"] else "O_DIRECT") if row["o_direct"] else "buffered"
        print(f"| {row['label']} | {row['chunk_bytes'] >> 20} MiB | {row['depth']} | {row['batch']} "
              f"| {mode} | {cell(row, 'write_gib_s')} | {cell(row, 'read_gib_s')} "
              f"| {cell(row, 'write_vs_fio')} | {cell(row, 'read_vs_fio')} "
              f"| {cell(row, 'write_vs_naive')} | {cell(row, 'read_vs_naive')} "
              f"| {cell(row, 'aiofiles_vs_kvtier')} | {row['verify_cost']:.0%} |")


if __name__ == "__main__":
    main()
