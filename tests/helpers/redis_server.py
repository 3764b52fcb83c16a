"""A real redis-server for the remote tier's tests and benchmarks: on 127.0.0.1 only, no
persistence, a free port, started and stopped (and restarted on the same port) by the
tests, and killed with the process that started it however that process dies."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.subprocesses import die_with_parent

BINARY = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(BINARY is None, reason="redis-server is not installed "
                                 "(apt-get install -y redis-server; .ci/run installs it)")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus``, one whose cluster bus port (+10000) is free too.

    A cluster node's pair lies below the kernel's ephemeral range, so no outgoing connection
    (the other nodes' own bus links) can take the bus port between this check and the bind."""
    if not bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    top = max(_ephemeral_low() - 10000, 12000)
    for port in random.sample(range(10000, top), min(200, top - 10000)):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, workdir: Path, *extra: str) -> None:
        self.workdir, self.extra = workdir, extra
        self.port = free_port(bus="--cluster-enabled" in extra)
        self.process: subprocess.Popen | None = None
        self.started = False  # once up, a restart keeps its port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start on this server's port; a first start that loses its port to a race (another
        process bound it since ``free_port``) retries on a new one."""
        for _ in range(4):
            try:
                return self._start()
            except AssertionError:
                if self.started or "Address already in use" not in self.log():
                    raise
                for stale in [self.workdir / "redis.log", *self.workdir.glob("nodes-*.conf")]:
                    stale.unlink(missing_ok=True)
                self.port = free_port(bus="--cluster-enabled" in self.extra)
        return self._start()

    def _start(self) -> RedisServer:
        assert BINARY is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [BINARY, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / "redis.log"), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    self.started = True
                    return self
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, \
                    f"redis-server did not start: {self.log()[-2000:]}"
                time.sleep(0.02)

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=20)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


class RedisCluster:
    """Three redis-server primaries in cluster mode on loopback, slots spread over them,
    each with ``replicas`` replicas (which take over when it fails). A node that answers no
    other for ``node_timeout_ms`` is failed by them: its replica takes over, or without one
    the cluster refuses every command (``CLUSTERDOWN``) until it is back."""

    def __init__(self, workdir: Path, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        self.replicas = replicas
        self.nodes = [RedisServer(workdir / f"node{i}", "--cluster-enabled", "yes",
                                  "--cluster-config-file", f"nodes-{i}.conf",
                                  "--cluster-node-timeout", str(node_timeout_ms),
                                  # a replica takes over however long since it last synced
                                  "--cluster-replica-validity-factor", "0")
                      for i in range(3 * (1 + replicas))]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        assert cli is not None
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        deadline = time.monotonic() + 120  # (a busy machine: past 60 s once in CI)
        for node in self.nodes:  # every node agrees the cluster is up, with all its slots
            while not self._ready(cli, node):
                assert time.monotonic() < deadline, "the cluster never came up"
                time.sleep(0.1)
        return self

    def _ready(self, cli: str, node: RedisServer) -> bool:
        info = subprocess.run([cli, "-p", str(node.port), "cluster", "info"],
                              capture_output=True, timeout=10).stdout
        if not (b"cluster_state:ok" in info and b"cluster_slots_ok:16384" in info
                and f"cluster_known_nodes:{len(self.nodes)}".encode() in info):
            return False
        replication = node.client().info("replication")
        return replication["role"] == "master" or replication.get("master_link_status") == "up"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def primaries(self) -> list[RedisServer]:
        """The nodes serving slots now (a replica promoted after a failover among them)."""
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None
                and n.client().info("replication").get("role") == "master"]
