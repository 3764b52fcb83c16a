"""Engine runs in one process of their own: ``scripts/vllm_run.py --serve`` runs spec after
spec, each engine made and shut down in it, vLLM imported once (about 2 s an engine instead
of about 12). The tests' warm engine host and the benchmark scripts whose engines need no
process each (``scripts/workload.py``) run their engines through it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class EngineRunError(RuntimeError):
    """An engine run failed or timed out; the message has its traceback and the host's log."""


class EngineHost:
    """Contract: ``run(spec, workdir, name, timeout)`` runs ``spec`` (scripts/vllm_run.py's)
    in the host process and returns its JSON output, or raises ``EngineRunError``. A run that
    fails or times out ends the host (no engine's leftovers reach the next run); the next run
    starts a new one. ``env`` is the host process's environment; its log is
    ``workdir/engine-host.log``."""

    def __init__(self, env: dict[str, str], python: str = sys.executable) -> None:
        self.env, self.python = env, python
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    def _start(self, workdir: Path) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.log = workdir / "engine-host.log"
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(
                    [self.python, str(ROOT / "scripts" / "vllm_run.py"), "--serve"], cwd=ROOT,
                    env=self.env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                    text=True)
        return self.process

    def run(self, spec: dict, workdir: Path, name: str, timeout: float) -> dict:
        spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
        spec_path.write_text(json.dumps(spec))
        done = Path(f"{out_path}.done")
        for stale in (out_path, done):
            stale.unlink(missing_ok=True)
        process = self._start(workdir)
        assert process.stdin is not None
        process.stdin.write(f"{spec_path} {out_path}\n")
        process.stdin.flush()
        deadline = time.monotonic() + timeout
        while not done.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise EngineRunError(f"engine run {name}: the engine host "
                                     f"{'ended' if process.returncode else 'timed out'}:\n"
                                     f"{self.tail()}")
            time.sleep(0.02)
        status = done.read_text()
        if status != "ok":
            self.kill()
            raise EngineRunError(f"engine run {name} failed:\n{status[-6000:]}\n{self.tail()}")
        return json.loads(out_path.read_text())

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log and self.log.exists() else ""

    def close(self) -> None:
        """End the host: at the end of its input (its engines are shut down), else killed."""
        if self.process is not None and self.process.poll() is None and self.process.stdin:
            self.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
