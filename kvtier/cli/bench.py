"""``kvtier bench``: the standalone offload benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail
from kvtier.units import format_size, parse_duration, parse_size

Opt = typer.Option


@app.command()
def bench(
    model: Annotated[str, Opt(help="KV shape preset: llama-3-8b, qwen2.5-32b, llama-3-70b, or "
                                   "custom (then --layers, --kv-heads, --head-dim).")] = "llama-3-8b",
    layers: Annotated[int | None, Opt(help="Custom: layers.")] = None,
    kv_heads: Annotated[int | None, Opt(help="Custom: KV heads.")] = None,
    head_dim: Annotated[int | None, Opt(help="Custom: head size.")] = None,
    dtype: Annotated[str, Opt(help="Custom: KV dtype.")] = "bfloat16",
    chunk_tokens: Annotated[int, Opt(help="Tokens per chunk.")] = 256,
    size: Annotated[str, Opt(help="Bytes moved per pass.")] = "1GiB",
    depths: Annotated[str, Opt(help="Disk queue depths (I/O threads).")] = "1,4,16",
    disk_path: Annotated[list[Path] | None, Opt(help="Directory for the disk tier; repeat it to "
                                                     "stripe over several drives (default: a "
                                                     "temporary directory).")] = None,
    no_disk: Annotated[bool, Opt("--no-disk", help="Host tier only.")] = False,
    duration: Annotated[str | None, Opt(help="Measure each disk queue depth at least this long "
                                             "(e.g. 30s), repeating passes; the best counts.")] = None,
    compression: Annotated[bool, Opt(help="zstd on the disk tier.")] = False,
    baselines: Annotated[bool, Opt(help="Also fio (when installed) and the naive "
                                        "one-file-per-chunk baseline.")] = True,
    prompt_tokens: Annotated[str, Opt(help="Prompt lengths for the TTFT estimate.")] = (
        "1024,4096,16384,65536"),
    prefill_tps: Annotated[float | None, Opt(help="Prefill speed in tokens/s for the TTFT "
                                                  "estimate (default: a per-preset guess).")] = None,
    out: Annotated[Path, Opt(help="Directory for bench.json and bench.png.")] = Path("kvtier-bench"),
    as_json: JsonFlag = False,
) -> None:
    """Measure store/load bandwidth and chunk latency of the host and disk tiers, against fio
    and a naive baseline, and estimate TTFT of loading against recomputing."""
    from kvtier.bench.offload import PRESETS, BenchSpec, run
    from kvtier.layout import KVLayout

    try:
        if model == "custom" or layers or kv_heads or head_dim:
            if not (layers and kv_heads and head_dim):
                raise ValueError("a custom model needs --layers, --kv-heads and --head-dim")
            layout, name = KVLayout(layers, kv_heads, head_dim, dtype), "custom"
        elif model in PRESETS:
            layout, name = PRESETS[model], model
        else:
            raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}, custom")
        spec = BenchSpec(layout=layout, name=name, chunk_tokens=chunk_tokens, size=parse_size(size),
                         depths=[int(d) for d in depths.split(",")], disk=not no_disk,
                         disk_paths=list(disk_path or []), compression=compression,
                         baselines=baselines,
                         prompt_tokens=[int(t) for t in prompt_tokens.split(",")],
                         prefill_tps=prefill_tps,
                         seconds_per_depth=parse_duration(duration) if duration else 0.0)
    except ValueError as exc:
        raise fail(f"bench: {exc}") from exc
    for path in disk_path or []:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)

    from rich.progress import Progress

    with Progress(console=console, transient=True, disable=as_json) as bar:
        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        result = run(spec, progress)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    png = None
    try:
        from kvtier.bench.plot import plot

        png = plot(result, out / "bench.png")
    except ImportError:
        console.print("matplotlib is not installed: no plot (pip install 'kvtier[bench]')")
    if as_json:
        emit_json(result)
        return
    _print(result, png, out)


def _print(result: dict, png: Path | None, out: Path) -> None:
    from rich.table import Table

    chunk = format_size(result["chunk_bytes"])
    table = Table("tier", "depth", "store GiB/s", "load GiB/s", "store p50/p99 ms",
                  "load p50/p99 ms", "store/fio", "load/fio",
                  title=f"kvtier bench: {result['preset']}, {chunk} chunks, {format_size(result['size'])}")

    def lat(d: dict) -> str:
        return f"{d.get('p50_ms', 0):.2f}/{d.get('p99_ms', 0):.2f}"

    host = result["host"]
    table.add_row("host", "-", f"{host['store_gib_s']:.2f}", f"{host['load_gib_s']:.2f}",
                  lat(host["store_latency"]), lat(host["load_latency"]), "-", "-")
    disk = result["disk"]
    for row in disk["depths"] if disk else []:
        ratios = [f"{row[k]:.2f}" if k in row else "-" for k in ("store_vs_fio", "load_vs_fio")]
        table.add_row("disk", str(row["depth"]), f"{row['store_gib_s']:.2f}",
                      f"{row['load_gib_s']:.2f}", lat(row["store_latency"]),
                      lat(row["load_latency"]), *ratios)
    if disk and disk["naive"]:
        table.add_row("naive files", "1", f"{disk['naive']['store_gib_s']:.2f}",
                      f"{disk['naive']['load_gib_s']:.2f}", "-", "-", "-", "-")
    console.print(table)
    ttft = result["ttft"]
    assumed = " (assumed; set --prefill-tps)" if ttft["prefill_assumed"] else ""
    estimate = Table("prompt tokens", "recompute s", "load from host s", "load from disk s",
                     title=f"TTFT estimate at {ttft['prefill_tps']:.0f} tokens/s prefill{assumed}")
    for row in ttft["rows"]:
        estimate.add_row(str(row["tokens"]), f"{row['recompute_s']:.3f}", f"{row['host_s']:.4f}",
                         f"{row['disk_s']:.4f}" if "disk_s" in row else "-")
    console.print(estimate)
    console.print(f"wrote {out / 'bench.json'}" + (f" and {png}" if png else ""))
