"""The real stores the remote tier's contract suite (``remote_contract.RemoteContract``) runs
on, each behind one small interface: make tiers of it, read and write its values raw (to
damage them), take it down and bring it back empty, hang it and resume it, and a small one
that fills up.

One store serves every test of a class; each test has keys of its own (a prefix of its own)
and leaves the store up, so that only the tests that take it down pay for a restart.
Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.values import value_key

RAW = 64 * 1024
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
RETRY_S = 0.3
_tests = itertools.count()


class ContractStore(ABC):
    """A store the contract runs on. ``timeout_s``: a tier's timeout here (what a round trip
    to a store that does not answer may take), ``hang_timeout_s`` that of a tier meeting a
    hung store (short, where connecting is cheap); ``overflow``: chunks of ``RAW`` that more
    than fill the store ``small()`` gives."""

    timeout_s, hang_timeout_s = 1.0, 0.5
    overflow = 320

    def __init__(self) -> None:
        self.prefix = "kvtier:"
        self._tiers: list[RemoteTier] = []

    def begin(self) -> None:
        """A test starts: keys of its own."""
        self.prefix = f"kvtier{next(_tests)}:"

    def end(self) -> None:
        """A test ended: its tiers closed, the store up and answering again."""
        for tier in self._tiers:
            tier.close()
        self._tiers.clear()
        self.resume()
        if not self.up():
            self.start()

    def tier(self, *, namespace: Namespace = NS, raw_bytes: int = RAW, parts: Sequence[int] = (),
             prefix: str | None = None, timeout_s: float | None = None,
             retry_s: float = RETRY_S) -> RemoteTier:
        """A tier of this store, closed when the test ends."""
        made = self._make(namespace, raw_bytes, timeout_s=self.timeout_s if timeout_s is None
                          else timeout_s, retry_s=retry_s, prefix=prefix or self.prefix,
                          parts=tuple(parts))
        self._tiers.append(made)
        return made

    def copies(self, tier: RemoteTier) -> int | None:
        """Chunks ``tier`` has copied through a buffer of its own, where the backend moves
        chunks by DMA and counts them (None: it does not)."""
        return None

    def name(self, key: ChunkKey, namespace: Namespace = NS) -> bytes:
        """The store's key of ``key``'s value, for this test's tiers."""
        return value_key(self.prefix, namespace.digest(), key)

    @abstractmethod
    def _make(self, namespace: Namespace, raw_bytes: int, **options: Any) -> RemoteTier: ...

    @abstractmethod
    def raw_get(self, name: bytes) -> bytes | None: ...

    @abstractmethod
    def raw_set(self, name: bytes, value: bytes) -> None:
        """Replace the value under ``name`` with ``value``, as another writer would."""

    @abstractmethod
    def raw_delete(self, name: bytes) -> None:
        """Drop the value under ``name``, as an eviction would."""

    @abstractmethod
    def stop(self) -> None:
        """Kill the store: every value is gone with it."""

    @abstractmethod
    def start(self) -> None:
        """Start it again, empty, at the same address; return once it serves."""

    @abstractmethod
    def up(self) -> bool: ...

    @abstractmethod
    def hang(self) -> None:
        """Stop the store answering (SIGSTOP): connections stay open, no replies."""

    @abstractmethod
    def resume(self) -> None:
        """Undo ``hang`` (nothing if it was not hung)."""

    @abstractmethod
    def small(self) -> contextlib.AbstractContextManager[ContractStore]:
        """A store with room for fewer than ``overflow`` chunks of ``RAW``."""


def _alive(process: Any) -> bool:
    return process is not None and process.poll() is None


def _signal(process: Any, sig: int) -> None:
    if _alive(process):
        os.kill(process.pid, sig)


# -- Valkey/Redis ----------------------------------------------------------------------------

class _RedisBacked(ContractStore):
    """What a Redis store and a Redis cluster do alike: tiers on ``url``, raw values through
    the ``_raw`` client."""

    _raw: Any

    @property
    @abstractmethod
    def url(self) -> str: ...

    def _make(self, namespace: Namespace, raw_bytes: int, **options: Any) -> RemoteTier:
        from kvtier.remote.redis_tier import RedisTier

        return RedisTier(self.url, namespace, raw_bytes, **options)

    def raw_get(self, name: bytes) -> bytes | None:
        return self._raw.get(name)

    def raw_set(self, name: bytes, value: bytes) -> None:
        self._raw.set(name, value)

    def raw_delete(self, name: bytes) -> None:
        self._raw.delete(name)


class RedisStore(_RedisBacked):
    """One redis-server on loopback (``redis_server.RedisServer``)."""

    @property
    def url(self) -> str:
        return self.server.url

    timeout_s, hang_timeout_s = 2.0, 0.3  # room for a busy machine; short to meet a hang

    def __init__(self, workdir: Path, *server_args: str) -> None:
        from tests.helpers.redis_server import RedisServer

        super().__init__()
        self.server = RedisServer(workdir, *server_args).start()
        self._raw = self.server.client()

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()

    def up(self) -> bool:
        return _alive(self.server.process)

    def hang(self) -> None:
        _signal(self.server.process, signal.SIGSTOP)

    def resume(self) -> None:
        _signal(self.server.process, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self._raw.close()
        self.server.stop()

    @contextlib.contextmanager
    def small(self) -> Iterator[ContractStore]:
        store = RedisStore(self.server.workdir.with_name("small"), "--maxmemory", "4mb",
                           "--maxmemory-policy", "allkeys-lru")
        store.prefix = self.prefix
        try:
            yield store
        finally:
            store.end()
            store.close()


class RedisClusterStore(_RedisBacked):
    """Three redis-server primaries in cluster mode on loopback (``RedisCluster``)."""

    @property
    def url(self) -> str:
        return self.cluster.url

    timeout_s, hang_timeout_s = 10.0, 0.3  # a client asks for the slot map and command table
    overflow = 200

    def __init__(self, workdir: Path) -> None:
        import redis

        from tests.helpers.redis_server import RedisCluster

        super().__init__()
        self.cluster = RedisCluster(workdir).start()
        port = self.cluster.nodes[0].port
        self._raw = redis.RedisCluster(host="127.0.0.1", port=port, socket_timeout=5)

    def stop(self) -> None:
        self.cluster.stop()

    def start(self) -> None:
        """Every node anew, from its saved cluster configuration (slots and peers), empty;
        back once each says the cluster is up."""
        import redis

        for node in self.cluster.nodes:
            node.start()
        deadline = time.monotonic() + 60
        for node in self.cluster.nodes:
            client = node.client()
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster never came back"
                time.sleep(0.05)
            client.close()
        self._raw.close()
        self._raw = redis.RedisCluster(host="127.0.0.1", port=self.cluster.nodes[0].port,
                                       socket_timeout=5)

    def up(self) -> bool:
        return all(_alive(node.process) for node in self.cluster.nodes)

    def hang(self) -> None:
        for node in self.cluster.nodes:
            _signal(node.process, signal.SIGSTOP)

    def resume(self) -> None:
        for node in self.cluster.nodes:
            _signal(node.process, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self._raw.close()
        self.cluster.stop()

    @contextlib.contextmanager
    def small(self) -> Iterator[ContractStore]:
        """This cluster, each node evicting past what it holds now and 1.5 MiB."""
        clients = [node.client() for node in self.cluster.nodes]
        try:
            for client in clients:
                used = int(client.info("memory")["used_memory"])
                client.config_set("maxmemory-policy", "allkeys-lru")
                client.config_set("maxmemory", used + 3 * 2**19)
            yield self
        finally:
            for client in clients:
                client.config_set("maxmemory", 0)
                client.config_set("maxmemory-policy", "noeviction")
                client.close()


# -- Mooncake Store ----------------------------------------------------------------------------

class MooncakeStore(ContractStore):
    """A ``mooncake_master`` and a holder lending it memory (``MooncakeServer``), inside a
    private network namespace; its tiers are pure clients, so bytes cross TCP loopback."""

    def __init__(self, workdir: Path, segment: int = 256 * 2**20) -> None:
        from tests.helpers.mooncake_server import MooncakeServer

        super().__init__()
        self.server = MooncakeServer(workdir, segment).start()
        self._raw = self.server.client()

    def _make(self, namespace: Namespace, raw_bytes: int, **options: Any) -> RemoteTier:
        from kvtier.remote.mooncake_tier import MooncakeTier

        return MooncakeTier(self.server.url, namespace, raw_bytes, **options)

    def copies(self, tier: RemoteTier) -> int | None:
        return int(tier.staged)  # type: ignore[attr-defined]

    def raw_get(self, name: bytes) -> bytes | None:
        value = self._raw.get(name.decode())
        return bytes(value) if value else None

    def raw_set(self, name: bytes, value: bytes) -> None:
        self._raw.remove(name.decode(), True)
        assert self._raw.put(name.decode(), value) == 0

    def raw_delete(self, name: bytes) -> None:
        assert self._raw.remove(name.decode(), True) == 0

    def stop(self) -> None:
        self.server.kill_master()

    def start(self) -> None:
        self.server.start()  # master and holder anew
        self._raw = self.server.client()

    def up(self) -> bool:
        return _alive(self.server.master) and _alive(self.server.holder)

    def hang(self) -> None:
        self.server.pause(self.server.master)

    def resume(self) -> None:
        for process in (self.server.master, self.server.holder):
            _signal(process, signal.SIGCONT)

    def close(self) -> None:
        self.server.stop()

    @contextlib.contextmanager
    def small(self) -> Iterator[ContractStore]:
        store = MooncakeStore(self.server.workdir.with_name("small"), 16 * 2**20)  # 255 values
        store.prefix = self.prefix
        try:
            yield store
        finally:
            store.end()
            store.close()
