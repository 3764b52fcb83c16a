"""Helpers to run the real vLLM CPU engine in a fresh process (scripts/vllm_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def tiny_model(where: Path) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_model import make_model

    return make_model(where / "tiny", "tiny")


def family_model(where: Path, family: str) -> Path:
    """A tiny random model of ``family`` (scripts/make_model.py): ``gemma3`` (sliding-window
    and full-attention layers: two KV cache groups), ``mistral`` (a sliding window on every
    layer), ``deepseek`` (MLA), ``llama4`` (chunked local attention and global layers)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_model import make_model

    return make_model(where / f"{family}-tiny", "tiny", family=family)


def prompts(seed: int, count: int, length: int, shared: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids; the first ``shared`` are common."""
    rng = np.random.default_rng(seed)
    common = rng.integers(100, 30000, size=shared).tolist()
    return [common + rng.integers(100, 30000, size=length - shared).tolist() for _ in range(count)]


def spec(model, connector=None, extra=None, phases=(), **engine) -> dict:
    """A scripts/vllm_run.py spec: float32, vLLM's prefix cache off, ``engine`` settings added."""
    return {"model": str(model), "connector": connector, "extra": extra or {},
            "dtype": "float32", "prefix_caching": False, "phases": list(phases), **engine}


def phase(batch, together=False, max_tokens=8, salt=None) -> dict:
    return {"prompts": batch, "together": together, "max_tokens": max_tokens, "salt": salt}


def disk_extra(disk: Path, chunk_tokens: int) -> dict:
    """kvtier's config for the engine tests: 64 MiB of host memory, a 256 MiB disk tier."""
    return {"chunk_tokens": chunk_tokens, "host_capacity": "64MiB", "disk_paths": [str(disk)],
            "disk_capacity": "256MiB", "load_policy": "always"}


def corrupt_every_slot(disk: Path, only: int | None = None) -> None:
    """Flip a byte in the payload of every slot (or of slot ``only``) of the one namespace
    under ``disk``."""
    (slots,) = disk.glob("*/writers/*/slots-0000.kvt")
    stride = json.loads((slots.parents[2] / "namespace.json").read_text())["stride"]
    data = bytearray(slots.read_bytes())
    for slot in range(len(data) // stride) if only is None else (only,):
        data[slot * stride + 4096 + 12345] ^= 0xFF
    slots.write_bytes(bytes(data))


def engine_command(spec: dict, workdir: Path, name: str,
                   extra_env: dict | None = None) -> tuple[list[str], dict, Path]:
    """(argv, environment, output path) of an engine run of ``spec`` in a new process."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    return [sys.executable, str(ROOT / "scripts" / "vllm_run.py"), str(spec_path),
            str(out_path)], engine_env(extra_env), out_path


def engine_env(extra_env: dict | None = None) -> dict:
    """An engine run's environment: this one's, without kvtier's variables, one process; the
    project's root on the path (a connector of the tests' own: tests/helpers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "all",
                "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(extra_env or {})})
    return env


def run_engine(spec: dict, workdir: Path, name: str, check: bool = True,
               timeout: int = 900, env: dict | None = None) -> dict | subprocess.CompletedProcess:
    """Run ``spec`` and return its JSON output (or, when ``check`` is false, the process on
    failure). A plain run (no environment of its own, one rank, its output checked) goes to
    this test process's warm engine host, where vLLM is imported once; any other runs in a new
    process of its own."""
    if check and not env and spec.get("tensor_parallel_size", 1) == 1:
        try:
            return warm_host().run(spec, workdir, name, timeout)
        except EngineRunError as exc:
            raise AssertionError(str(exc)) from None
    argv, full_env, out_path = engine_command(spec, workdir, name, env)
    process = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True,
                             timeout=timeout)
    if process.returncode != 0:
        if not check:
            return process
        raise AssertionError(f"engine run {name} failed:\n{process.stderr[-6000:]}")
    return json.loads(out_path.read_text())


sys.path.insert(0, str(ROOT / "scripts"))
from engine_host import EngineHost, EngineRunError  # noqa: E402  (scripts/engine_host.py)

_HOSTS: list[EngineHost] = []  # this test process's one warm engine host, once made


def warm_host() -> EngineHost:
    """This test process's engine host (its environment: this process's at its first run)."""
    if not _HOSTS:
        _HOSTS.append(EngineHost(engine_env()))
    return _HOSTS[0]


def close_warm_host() -> None:
    for host in _HOSTS:
        host.close()
