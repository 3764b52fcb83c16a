"""The PNG of ``kvtier bench``: bandwidth against queue depth, TTFT against prompt length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot(result: dict, path: Path) -> Path:
    """Draw ``result`` (what ``kvtier bench`` writes to bench.json) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_bandwidth(bw, result)
    _plot_ttft(ttft, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_bandwidth(bw: Axes, result: dict) -> None:
    """kvtier's disk store and load GiB/s by queue depth, with fio's and the naive baseline's
    when measured; without a disk tier, only the axes' labels and title."""
    disk = result.get("disk")
    if disk:
        depths = [r["depth"] for r in disk["depths"]]
        bw.plot(depths, [r["load_gib_s"] for r in disk["depths"]], "o-", label="kvtier load")
        bw.plot(depths, [r["store_gib_s"] for r in disk["depths"]], "s-", label="kvtier store")
        if "fio_read_gib_s" in disk["depths"][0]:
            bw.plot(depths, [r["fio_read_gib_s"] for r in disk["depths"]], "o--", label="fio read")
            bw.plot(depths, [r["fio_write_gib_s"] for r in disk["depths"]], "s--", label="fio write")
        if disk.get("naive"):
            bw.axhline(disk["naive"]["load_gib_s"], color="grey", linestyle=":",
                       label="one file per chunk, read")
        bw.set_xscale("log", base=2)
        bw.set_xticks(depths, [str(d) for d in depths])
    bw.set_xlabel("queue depth (I/O threads)")
    bw.set_ylabel("GiB/s")
    bw.set_title(f"disk tier, {result['chunk_bytes'] / 2**20:.0f} MiB chunks")
    bw.grid(True, alpha=0.3)
    if disk:
        bw.legend()


def _plot_ttft(ttft: Axes, result: dict) -> None:
    """Seconds to first token by prompt length: recompute, load from host, load from disk."""
    rows = result["ttft"]["rows"]
    tokens = [r["tokens"] for r in rows]
    ttft.plot(tokens, [r["recompute_s"] for r in rows], "x-", label="recompute (prefill)")
    ttft.plot(tokens, [r["host_s"] for r in rows], "o-", label="load from host memory")
    if "disk_s" in rows[0]:
        ttft.plot(tokens, [r["disk_s"] for r in rows], "s-", label="load from disk")
    ttft.set_xscale("log", base=2)
    ttft.set_yscale("log")
    ttft.set_xlabel("prompt tokens")
    ttft.set_ylabel("seconds")
    assumed = " (assumed)" if result["ttft"]["prefill_assumed"] else ""
    ttft.set_title(f"TTFT estimate, {result['preset']}, prefill "
                   f"{result['ttft']['prefill_tps']:.0f} tok/s{assumed}")
    ttft.grid(True, which="both", alpha=0.3)
    ttft.legend()
