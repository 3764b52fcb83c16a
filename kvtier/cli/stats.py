"""``kvtier stats URL``: a running store's or engine's kvtier metrics, as a table."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Annotated

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail


def read_metrics(url: str, timeout: float = 10.0) -> list[dict]:
    """The ``kvtier_*`` samples served at ``url`` (``/metrics`` added when there is no path)."""
    from prometheus_client.parser import text_string_to_metric_families

    if "://" not in url:
        url = f"http://{url}"
    if url.rstrip("/").count("/") < 3:
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvtier_") and not sample.name.endswith("_created"):
                samples.append({"name": sample.name, "labels": dict(sample.labels),
                                "value": sample.value})
    return samples


@app.command()
def stats(url: Annotated[str, typer.Argument(help="host:port or URL of a metrics endpoint "
                                                  "(metrics_port).")],
          as_json: JsonFlag = False) -> None:
    """Print the kvtier metrics a running store or engine serves on its metrics_port."""
    try:
        samples = read_metrics(url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise fail(f"stats: cannot read metrics from {url}: {exc}", code=1) from exc
    if as_json:
        emit_json({"url": url, "samples": samples})
        return
    from rich.table import Table

    table = Table("metric", "labels", "value", title=f"kvtier metrics at {url}")
    for sample in samples:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(sample["labels"].items()))
        value = sample["value"]
        table.add_row(sample["name"].removeprefix("kvtier_"), labels,
                      f"{value:.0f}" if float(value).is_integer() else f"{value:.3f}")
    console.print(table)
    if not samples:
        console.print("no kvtier metrics at that address")
