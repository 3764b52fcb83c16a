"""vLLM's OpenAI servers with kvtier, behind vllm-router: every server on 127.0.0.1, every
process ended on ``close`` (tests/test_vllm_router.py, scripts/bench_router.py).

Each engine publishes vLLM's KV events (its GPU cache's, and through kvtier's
``take_events`` its host and disk tiers') on a ZMQ socket the router subscribes to.
vllm-router only connects (``--kv-event-source URL=tcp://HOST:PORT``, a TCP endpoint only)
and vLLM's publisher binds only an endpoint with ``*`` or ``::`` in it (it connects to any
other), so each engine binds ``tcp://[::ffff:127.0.0.1]:PORT``: the IPv4-mapped loopback
address, which ZMQ binds as 127.0.0.1. The router's static sources take vLLM's default
topic (the empty one) and drop every other: an engine given a ``topic`` is never heard.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.helpers.metrics import free_ports
from tests.helpers.subprocesses import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128  # vLLM's KV block on CPU: the router's --kv-event-block-size
SERVED = "tiny"  # the model's name on every engine: the router's --kv-event-model


def have_router() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def free_port(count: int = 1) -> int:
    """The first of ``count`` free loopback ports below the ephemeral range (``free_ports``)."""
    return free_ports(count)


@dataclass(frozen=True)
class EngineConfig:
    """One engine: kvtier's extra config, vLLM's KV cache in blocks, kvtier's events held
    back (``quiet``: tests/helpers/quiet_connector.py), the core it is pinned to (None: all)."""

    model: Path
    extra: dict
    gpu_blocks: int
    max_model_len: int | None = None  # None: what ``gpu_blocks`` hold (one is vLLM's null block)
    quiet: bool = False
    cpu: int | None = None
    role: str = "kv_both"  # vLLM's kv_role: kv_producer and kv_consumer split prefill and decode
    events: bool = True  # publish vLLM's KV events (a kv_aware router's)
    prefix_caching: bool = True  # vLLM's own prefix cache


@dataclass(frozen=True)
class Engine:
    url: str
    events: str  # the endpoint the router connects to
    metrics: str | None  # kvtier's scheduler-side metrics (extra config ``metrics_port``)


def engine_argv(config: EngineConfig, port: int, events_port: int) -> list[str]:
    module, name = (("tests.helpers.quiet_connector", "KVTierConnectorNoEvents") if config.quiet
                    else ("kvtier.connector", "KVTierConnector"))
    connector = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": config.role,
                 "kv_connector_extra_config": config.extra}
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://[::ffff:127.0.0.1]:{events_port}"}
    length = config.max_model_len or (config.gpu_blocks - 1) * BLOCK
    caching = "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching"
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(config.model), "--served-model-name", SERVED,
            "--dtype", "float32", "--enforce-eager", caching, "--max-model-len", str(length),
            "--num-gpu-blocks-override", str(config.gpu_blocks), "--uvicorn-log-level", "warning",
            "--kv-transfer-config", json.dumps(connector),
            *(["--kv-events-config", json.dumps(events)] if config.events else []),
            # prompts as token ids; or, where the model has a tokenizer (scripts/bench_router.py's),
            # text, whose ids a kv_aware router asks the engines for (/v1/completions/render)
            *(["--enable-scale-out"] if (Path(config.model) / "tokenizer.json").exists()
              else ["--skip-tokenizer-init"])]


def router_argv(policy: str, port: int, metrics_port: int, engines: list[Engine],
                log_level: str = "info", extra: tuple[str, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *[e.url for e in engines], "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", log_level]
    if policy == "kv_aware":
        for engine in engines:
            argv += ["--kv-event-source", f"{engine.url}={engine.events}"]
        argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", SERVED]
    return [*argv, *extra]


def pd_router_argv(port: int, metrics_port: int, prefill: Engine, decode: Engine) -> list[str]:
    """vllm-router's PD mode (its default, nixl: the prefill answer's ``kv_transfer_params``
    handed to the decode request as they came)."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--vllm-pd-disaggregation", "--prefill", prefill.url,
            "--decode", decode.url, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "info"]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


class Fleet:
    """Contract: ``start_engines`` starts every engine at once and returns when all serve;
    ``start_router`` puts vllm-router in front of them with ``policy`` and returns its URL;
    ``stop_router``/``stop_engines`` end those (the whole process group, SIGKILL after 10 s);
    ``close`` (or leaving the ``with``) ends everything. A server that exits or does not
    answer within ``timeout`` raises ``RuntimeError`` with its log's tail. Logs go to
    ``work``; ``env`` is the engines' environment."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.engines: list[Engine] = []
        self.router: str | None = None
        self.router_metrics: str | None = None
        self._engines: list[subprocess.Popen] = []
        self._router: subprocess.Popen | None = None

    def _spawn(self, argv: list[str], env: dict, log: Path, cpu: int | None) -> subprocess.Popen:
        def child() -> None:
            die_with_parent()
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})

        with open(log, "ab") as out:
            return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=child)

    def _wait(self, process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            with contextlib.suppress(OSError, http.client.HTTPException):
                http_get(url, timeout=2)
                return
            time.sleep(0.3)
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{url} did not come up (exit {process.poll()}):\n{tail}")

    def start_engines(self, configs: list[EngineConfig], timeout: float = 240.0) -> list[Engine]:
        started = []
        for i, config in enumerate(configs):
            port, events = free_port(), free_port()
            metrics = config.extra.get("metrics_port")
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", **self.env, "PYTHONPATH": str(ROOT)}
            if config.cpu is not None:
                env["OMP_NUM_THREADS"] = "1"
            log = self.work / f"engine-{i}.log"
            process = self._spawn(engine_argv(config, port, events), env, log, config.cpu)
            self._engines.append(process)
            engine = Engine(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}",
                            f"http://127.0.0.1:{metrics}/metrics" if metrics else None)
            started.append((process, engine, log))
        for process, engine, log in started:
            self._wait(process, f"{engine.url}/health", log, timeout)
        self.engines = [engine for _, engine, _ in started]
        return self.engines

    def start_router(self, policy: str, timeout: float = 60.0, log_level: str = "info",
                     extra: tuple[str, ...] = ()) -> str:
        port, metrics = free_port(), free_port()
        argv = router_argv(policy, port, metrics, self.engines, log_level, extra)
        return self._start_router(argv, port, metrics, f"router-{policy}.log", timeout)

    def start_pd_router(self, prefill: Engine, decode: Engine, timeout: float = 60.0) -> str:
        """A router in PD mode: each request to ``prefill``, then to ``decode``; its URL. A
        second one stops the first."""
        self.stop_router()
        port, metrics = free_port(), free_port()
        argv = pd_router_argv(port, metrics, prefill, decode)
        return self._start_router(argv, port, metrics, f"router-pd-{port}.log", timeout)

    def _start_router(self, argv: list[str], port: int, metrics: int, log_name: str,
                      timeout: float) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self._router = self._spawn(argv, env, self.work / log_name, None)
        self.router, self.router_metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"
        self._wait(self._router, f"{self.router}/readiness", self.work / log_name, timeout)
        return self.router

    def stop_router(self) -> None:
        if self._router is not None:
            stop(self._router)
        self._router = self.router = None

    def stop_engines(self) -> None:
        for process in self._engines:
            stop(process)
        self._engines, self.engines = [], []

    def close(self) -> None:
        self.stop_router()
        self.stop_engines()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """End ``process`` and every process of its group (its session: vLLM's engine core):
    SIGTERM, then after at most ``grace`` seconds SIGKILL to whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def scrape(url: str) -> dict[str, float]:
    """A Prometheus page: each sample's value by its name and labels, as written."""
    samples = {}
    for line in http_get(url).splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry every label of ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(value for key, value in samples.items()
               if key.split("{")[0] == name and all(w in key for w in wanted))


@dataclass(frozen=True)
class Reply:
    ttft: float  # seconds to the first streamed token
    seconds: float  # to the last


def complete(url: str, prompt: list[int] | str, max_tokens: int = 1,
             timeout: float = 120.0, session: str | None = None) -> Reply:
    """A streamed greedy completion of ``prompt`` (token ids, or text where the model has a
    tokenizer) at ``url`` (an engine or the router), in conversation ``session`` where given
    (header ``X-Session-ID``, which vllm-router keys session affinity on); RuntimeError on an
    answer other than 200."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    start, first = time.monotonic(), None
    try:
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers["X-Session-ID"] = session
        connection.request("POST", "/v1/completions", json.dumps(body), headers)
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status}: {reply.read()[:500]!r}")
        for line in reply:
            if line.startswith(b"data: ") and first is None:
                first = time.monotonic()
    finally:
        connection.close()
    end = time.monotonic()
    return Reply((first or end) - start, end - start)


def completion(url: str, prompt: list[int], max_tokens: int = 8, params: dict | None = None,
               timeout: float = 120.0) -> dict:
    """A greedy completion of ``prompt`` (token ids) at ``url``, not streamed: vLLM's answer
    (``kv_transfer_params`` sent along when given)."""
    body: dict = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())
