"""Time ``kvtier stats`` and ``kvtier top --once`` on a large metrics page, as a user runs them.

    python scripts/bench_stats.py [--samples 100000] [--repeat 3]

Serves a page of N ``kvtier_*`` samples (counters and gauges with two labels, as endpoints
write them) on loopback, then runs ``kvtier stats URL`` (text, one line a sample past 1,000)
and ``kvtier stats URL --json`` as separate processes, output to /dev/null, and reports the
best wall time and the CPU time of each, beside ``kvtier version`` (the cost of starting
Python and kvtier). ``kvtier top --once`` and ``--json`` read a page of the same size whose
samples fall in five tiers (as an engine's do; ``top`` refuses a page of more than 64 tiers
as not kvtier's), with a ``rank`` label taking the rest. The goal is under 2 s for 100,000
samples.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def page(samples: int, tiers: int | None = None) -> bytes:
    """A page of ``samples`` samples over a few metric names, as an endpoint writes it: each
    in a tier of its own, or in one of ``tiers`` with a ``rank`` of its own."""
    names = [("kvtier_chunks_loaded_total", "counter"), ("kvtier_slots", "gauge"),
             ("kvtier_disk_bytes_total", "counter"), ("kvtier_io_queue_depth", "gauge")]
    lines: list[str] = []
    per_name = -(-samples // len(names))
    for name, kind in names:
        lines += [f"# HELP {name} what it counts", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{tier="t{i if tiers is None else i % tiers}",'
                  f'rank="{i % 8 if tiers is None else i}"}} {i * 3.5}' for i in range(per_name)]
    return ("\n".join(lines[:samples + 2 * len(names)]) + "\n").encode()


def serve(body: bytes) -> ThreadingHTTPServer:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def timed(args: list[str], repeat: int) -> dict[str, float]:
    """Best wall and CPU seconds of ``kvtier ARGS`` over ``repeat`` runs; fails loudly."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([*KVTIER, *args], stdout=subprocess.DEVNULL, check=True, timeout=600)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return {"wall_s": round(best_wall, 3), "cpu_s": round(best_cpu, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    body, tiered = page(args.samples), page(args.samples, tiers=5)
    server, top_server = serve(body), serve(tiered)
    url = f"127.0.0.1:{server.server_address[1]}"
    top_url = f"127.0.0.1:{top_server.server_address[1]}"
    try:
        results = {"samples": args.samples, "page_bytes": len(body),
                   "version": timed(["version"], args.repeat),
                   "stats": timed(["stats", url, "--timeout", "600"], args.repeat),
                   "stats --json": timed(["stats", url, "--json", "--timeout", "600"], args.repeat),
                   "top --once": timed(["top", top_url, "--once", "--interval", "0.1",
                                        "--timeout", "600"], args.repeat),
                   "top --json": timed(["top", top_url, "--json", "--interval", "0.1",
                                        "--timeout", "600"], args.repeat)}
    finally:
        server.shutdown()
        top_server.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
