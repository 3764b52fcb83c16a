"""``kvtier bench``: the standalone offload benchmark."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, shown
from kvtier.layout import KVLayout
from kvtier.units import format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from kvtier.bench.offload import BenchSpec

Opt = typer.Option
T = TypeVar("T")


ModelOpt = Annotated[str, Opt(help="KV shape preset: llama-3-8b, qwen2.5-32b, llama-3-70b, or "
                                  "custom (then --layers, --kv-heads, --head-dim).")]
LayersOpt = Annotated[int | None, Opt(help="Custom: layers.")]
KVHeadsOpt = Annotated[int | None, Opt(help="Custom: KV heads.")]
HeadDimOpt = Annotated[int | None, Opt(help="Custom: head size.")]
DtypeOpt = Annotated[str, Opt(help="Custom: KV dtype.")]
ChunkTokensOpt = Annotated[int, Opt(help="Tokens per chunk (a chunk must be at least 4 KiB).")]
SizeOpt = Annotated[str, Opt(help="Bytes moved per pass.")]
DepthsOpt = Annotated[str, Opt(help="Disk queue depths (I/O threads), 1 to 256.")]
DiskPathOpt = Annotated[list[Path] | None, Opt(help="Directory for the disk tier; repeat it to stripe over "
                                                    "several drives (default: a temporary directory).")]
NoDiskOpt = Annotated[bool, Opt("--no-disk", help="Host tier only.")]
DurationOpt = Annotated[str | None, Opt(help="Measure each disk queue depth at least this long (e.g. 30s), "
                                             "repeating passes; the best counts.")]
CompressionOpt = Annotated[bool, Opt(help="zstd on the disk tier.")]
BaselinesOpt = Annotated[bool, Opt(help="Also fio (when installed) and the naive "
                                        "one-file-per-chunk baseline.")]
PromptTokensOpt = Annotated[str, Opt(help="Prompt lengths for the TTFT estimate.")]
PrefillTpsOpt = Annotated[float | None, Opt(help="Prefill speed in tokens/s for the TTFT estimate "
                                                 "(default: a per-preset guess).")]
OutOpt = Annotated[Path, Opt(help="Directory for bench.json and bench.png.")]


@app.command()
def bench(
    model: ModelOpt = "llama-3-8b",
    layers: LayersOpt = None,
    kv_heads: KVHeadsOpt = None,
    head_dim: HeadDimOpt = None,
    dtype: DtypeOpt = "bfloat16",
    chunk_tokens: ChunkTokensOpt = 256,
    size: SizeOpt = "1GiB",
    depths: DepthsOpt = "1,4,16",
    disk_path: DiskPathOpt = None,
    no_disk: NoDiskOpt = False,
    duration: DurationOpt = None,
    compression: CompressionOpt = False,
    baselines: BaselinesOpt = True,
    prompt_tokens: PromptTokensOpt = "1024,4096,16384,65536",
    prefill_tps: PrefillTpsOpt = None,
    out: OutOpt = Path("kvtier-bench"),
    as_json: JsonFlag = False,
) -> None:
    """Measure store/load bandwidth and chunk latency of the host and disk tiers, against fio
    and a naive baseline, and estimate TTFT of loading against recomputing.

    Exits 2, before any work, on a bad argument; 1 when the run fails (a full or failing disk)."""
    try:
        spec = _spec(model=model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                     chunk_tokens=chunk_tokens, size=size, depths=depths, disk_paths=disk_path,
                     no_disk=no_disk, duration=duration, compression=compression,
                     baselines=baselines, prompt_tokens=prompt_tokens, prefill_tps=prefill_tps)
        _check_directories(spec, out)
    except ValueError as exc:
        raise fail(f"bench: {exc}") from exc
    _run_and_report(spec, out, as_json=as_json)


def _spec(*, model: str, layers: int | None, kv_heads: int | None, head_dim: int | None, dtype: str,
          chunk_tokens: int, size: str, depths: str, disk_paths: list[Path] | None, no_disk: bool,
          duration: str | None, compression: bool, baselines: bool, prompt_tokens: str,
          prefill_tps: float | None) -> BenchSpec:
    """The run the options ask for; ``ValueError``, naming the option, for one that cannot be."""
    from kvtier.bench.offload import BenchSpec

    layout, name = _layout(model, layers, kv_heads, head_dim, dtype)
    return BenchSpec(layout=layout, name=name, chunk_tokens=chunk_tokens,
                     size=_parsed("--size", parse_size, size),
                     depths=_ints("--depths", depths), disk=not no_disk,
                     disk_paths=list(disk_paths or []), compression=compression,
                     baselines=baselines, prompt_tokens=_ints("--prompt-tokens", prompt_tokens),
                     prefill_tps=prefill_tps,
                     seconds_per_depth=_parsed("--duration", parse_duration, duration or "0"))


def _run_and_report(spec: BenchSpec, out: Path, as_json: bool) -> None:
    """Run ``spec``, write the results into ``out``, then print the tables (or, ``as_json``,
    only the JSON). Exits 2 on a ``KVTIER_*`` variable the bench's store cannot take, 1 when
    the run or the writing fails."""
    from kvtier.errors import ConfigError

    try:
        result = _measure(spec, quiet=as_json)
    except ConfigError as exc:  # a KVTIER_* variable the bench's store cannot take
        raise fail(f"bench: {str(exc).removeprefix('kvtier ')}") from exc
    except (OSError, MemoryError) as exc:
        raise fail(f"bench: the run failed: {str(exc) or type(exc).__name__}", code=1) from exc
    try:
        png = _write(result, out)
    except OSError as exc:
        raise fail(f"bench: cannot write the results to {out}: {exc.strerror or exc}", code=1) from exc
    if as_json:
        emit_json(result)
        return
    _print(result, png, out)


def _layout(model: str, layers: int | None, kv_heads: int | None, head_dim: int | None,
            dtype: str) -> tuple[KVLayout, str]:
    from kvtier.bench.offload import PRESETS

    dims = (layers, kv_heads, head_dim)
    if model == "custom" or any(d is not None for d in dims):
        if layers is None or kv_heads is None or head_dim is None:
            raise ValueError("a custom model needs --layers, --kv-heads and --head-dim")
        if min(layers, kv_heads, head_dim) < 1:
            raise ValueError(f"--layers, --kv-heads and --head-dim must be at least 1, got {dims}")
        return KVLayout(layers, kv_heads, head_dim, dtype), "custom"
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}, custom")
    return PRESETS[model], model


def _parsed(option: str, parse: Callable[[str], T], text: str) -> T:
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _ints(option: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes whole numbers separated by commas, got {text!r}") from None


def _check_directories(spec: BenchSpec, out: Path) -> None:
    """Before any work: each disk path and ``--out`` is a directory (made if missing) that
    this user can write into. A disk path may not be a symbolic link."""
    for path in spec.disk_paths if spec.disk else []:
        if path.is_symlink():
            raise ValueError(f"--disk-path {path} is a symbolic link; give the directory itself")
        _writable_directory("--disk-path", path, mode=0o700)
    _writable_directory("--out", out)


def _writable_directory(option: str, path: Path, mode: int = 0o777) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} exists and is not a directory")
    probe = path / f".kvtier-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{option} {path} is not a directory this user can write into: "
                         f"{exc.strerror or exc}") from exc


def _measure(spec: BenchSpec, quiet: bool) -> dict:
    from rich.progress import Progress

    from kvtier.bench.offload import run

    with Progress(console=console, transient=True, disable=quiet) as bar:
        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        return run(spec, progress)


def _write(result: dict, out: Path) -> Path | None:
    """bench.json and, with matplotlib, bench.png in ``out``; the PNG's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    try:
        from kvtier.bench.plot import plot

        return plot(result, out / "bench.png")
    except ImportError:
        console.print(shown("matplotlib is not installed: no plot (pip install 'kvtier[bench]')"))
        return None


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
    console.print(f"wrote {shown(out / 'bench.json')}" + (f" and {shown(png)}" if png else ""))
