"""The Mooncake Store backend of the remote tier: ``mooncake://<master host>:<port>?<options>``
(``kvtier/config/mooncake_url.py`` says what the options are).

A value is kvtier's 128-byte header then the payload (``values.py``), moved as two pieces
(multi-buffer put and get): the header from or into a registered scratch of the calling
thread, the payload straight from or into the caller's buffer when it lies in memory given
to ``register`` (the host tier's), else through that scratch (``staged`` counts those).
Every value read is checked down to its payload's checksum; one that fails is removed, so
that the next put replaces it (a put never overwrites a value the store holds).

Time: every client call runs watched by one deadline, ``timeout_s`` from its start
(``WatchedCalls``): past it the tier is out of service at once; one still waiting for a call
thread at its deadline behind calls in time fails alone. The client's own timeouts come from
``timeout_s`` too (``MC_RPC_TIMEOUT_MS``, ``MC_TCP_PROGRESS_TIMEOUT_SEC``, each only where
unset). A dead master costs the client about 4.3 s a call and 4.4 s a setup, holding the
GIL, so before the setup, and before the first round trip after a failed one, the master's
port must take a TCP connection within ``timeout_s`` (a dead master refuses it at once); the
tier is back in service once a call succeeds (a paused master's kernel takes connections).
A holder whose transfer failed while the master answered goes out of service alone
(``mooncake_holders``): the other holders serve their keys meanwhile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, MutableMapping, Sequence
from typing import Any

import numpy as np

from kvtier.config.mooncake_url import parse_url
from kvtier.config.redact import redacted
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.mooncake_client import (
    RPC_FAIL,
    RPC_TIMEOUT,
    client_module,
    put_result,
    reachable,
    set_up,
    unreachable,
)
from kvtier.remote.mooncake_holders import Holders, Read, holders_of, pick
from kvtier.remote.mooncake_log import RecordLog
from kvtier.remote.mooncake_memory import RegisteredMemory
from kvtier.remote.mooncake_pieces import fill_pieces
from kvtier.remote.mooncake_reads import ValueReads
from kvtier.remote.values import ValueFormat, value_key
from kvtier.remote.watched_calls import CallsBusy, WatchedCalls


class MooncakeTier(RemoteTier):
    """``RemoteTier`` on Mooncake Store (``mooncake.store``, the ``mooncake`` extra): one
    client per tier, set up on first use; thread-safe (each thread has its own scratch).

    A call costs a fixed setup and its transfers share one engine: smaller or concurrent
    batches measured slower than one large one (``scripts/bench_remote_mooncake.py``), so
    reads and puts go in groups of up to 256 MiB."""

    read_group_bytes = put_group_bytes = 256 * 2**20

    def __init__(self, url: str, namespace: Namespace, raw_bytes: int, *, timeout_s: float = 2.0,
                 retry_s: float = 5.0, prefix: str = "kvtier:",
                 environ: MutableMapping[str, str] | None = None, parts: Sequence[int] = ()) -> None:
        super().__init__(raw_bytes, retry_s, parts)
        self.url, self._options = url, parse_url(url)
        self._ns, self._prefix, self._timeout_s = namespace.digest(), prefix, timeout_s
        self._format = ValueFormat(self._ns, raw_bytes, parts)
        self._hb = self._format.header_bytes  # a value's bytes before its payload
        self._environ, self._module = os.environ if environ is None else environ, client_module()
        self._lock, self._connecting = threading.Lock(), threading.Lock()  # (one setup at a time)
        self._client: Any = None  # set up on first use: a master down at start is a miss
        self._suspect = False  # a round trip failed: probe before the next one
        self._memory = RegisteredMemory(redacted(url), self._hb, raw_bytes)
        self._calls = WatchedCalls(timeout_s, self._failed, name="kvtier-mooncake")
        self._holders = Holders(retry_s, redacted(url))  # holders out of service alone
        self._reads = ValueReads(self._format, self._memory, self._trip_failed)
        self._log = RecordLog(f"{prefix}log:{self._ns.hex()}", self._ask, self._memory.area)

    @property
    def staged(self) -> int:
        """Chunks copied through a scratch (their buffers not registered)."""
        return self._memory.staged

    def describe(self) -> str:
        return redacted(self.url)

    def _names(self, keys: Sequence[ChunkKey]) -> list[str]:
        return [value_key(self._prefix, self._ns, k).decode() for k in keys]

    def _ready(self, what: str) -> Any:
        """The client, or an ``IOResult`` saying why not. Before it is set up, and after a failed
        round trip, the master's port must take a connection within ``timeout_s``."""
        if self.down:
            return self._out_of_service()
        with self._lock:
            client, suspect = self._client, self._suspect
        if client is not None and not suspect:
            return client
        try:
            reachable(self._options.master, self._timeout_s)
        except Exception as exc:  # OSError, each saying why
            return self._failed(what, exc)
        with self._connecting:  # one setup at a time: those that waited on a failed one
            if self._client is None:  # find the tier out of service, and do not try again
                if self.down:
                    return self._out_of_service()
                try:
                    self._connect()
                except Exception as exc:  # OSError, or a client refusing its arguments
                    return self._failed(what, exc)
        with self._lock:
            self._suspect = False
            client = self._client
        if client is None:
            return self._out_of_service()
        return client  # (back in service once a call through it works: ``_answered``)

    def _connect(self) -> None:
        """Set the client up (it holds the GIL meanwhile: a master reachable but hung
        costs the process up to its RPC timeout, ``timeout_s``)."""
        client = set_up(self._module, self._options, self._timeout_s, self._environ)
        with self._lock:
            if self._closed:
                client.close()
                raise ConnectionError("the tier was closed")
            self._client = client
            self._memory.register_all(client)

    def _failed(self, what: str, exc: BaseException) -> IOResult:
        with self._lock:
            self._suspect = True
        return super()._failed(what, exc)

    def _trip_failed(self, what: str, codes: Sequence[int]) -> IOResult | None:
        """The failure of a round trip the master did not answer (tier out of service)."""
        for code in codes:
            failure = unreachable(what, code)
            if failure is not None:
                return self._failed(what, failure)
        return None

    def register(self, memory: np.ndarray) -> None:
        """Register ``memory`` with the transfer engine (now, or once connected): chunks in it
        move with no copy (one the engine refuses is logged, its chunks staged)."""
        if not memory.flags.c_contiguous:
            raise ValueError("MooncakeTier.register takes contiguous memory (a host tier's buffer)")
        with self._lock:  # not while a client is set up: each is registered once
            self._memory.add(memory.reshape(-1).view(np.uint8), self._client)

    def _ask(self, what: str, call: Callable[[Any], Any],
             codes: Callable[[Any], Sequence[int]] = lambda answer: answer) -> Any:
        """``call(client)``'s answer (``codes(answer)``: the codes in it) for a call holding
        no caller memory (a lookup, a removal, the log's, whose scratch is its thread's):
        a late answer is not waited for; None when the round trip failed."""
        client = self._ready(what)
        if isinstance(client, IOResult):
            return None
        failures = self.failures
        try:
            answer = self._calls.run(what, lambda: call(client), holds_memory=False)
        except CallsBusy as exc:  # this call alone
            self._busy(what, exc)
            return None
        except Exception as exc:  # a client that refuses its arguments: a failed trip
            self._failed(what, exc)
            return None
        if answer is None or self._trip_failed(what, codes(answer)) is not None:
            return None
        self._answered(failures)
        return answer

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        held = self.exists_answered(keys)
        return [False] * len(keys) if held is None else [bool(h) for h in held]

    def exists_answered(self, keys: Sequence[ChunkKey]) -> list[bool | None] | None:
        """As the contract says (None when a call failed meanwhile); None for a key held
        only on holders out (a get misses it)."""
        names, failures = self._names(keys), self.failures
        codes = self._ask("exists", lambda client: client.batch_is_exist(names))
        if codes is None or self.failures != failures or self.down:
            return None
        held = [code == 1 for code in codes]
        if not (self._holders.outages.any() and any(held)):
            return list(held)
        found = self._ask("exists", lambda client: holders_of(client, names), lambda _: ())
        return self._holders.servable(held, found)  # (one more lookup while a holder is out)

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        return self._ask("remove", lambda c: c.batch_remove(self._names(keys), True)) is not None

    keeps_records = True  # batches under ``<prefix>log:<namespace digest>:<seq>`` (``mooncake_log``)

    def append_records(self, items: Sequence[tuple[ChunkKey, bytes]]) -> bool:
        return self._log.append(items)

    def read_records(self, after: bytes, count: int) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
        return self._log.read(after, count)

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray]) -> list[IOResult]:
        unfit = self._unfit(dsts)  # short, strided or read-only: that call fails, nothing else
        if unfit is not None:
            return [unfit] * len(keys)
        client = self._ready("get")
        if isinstance(client, IOResult):
            return [client] * len(keys)
        outs = [dst.reshape(-1).view(np.uint8) for dst in dsts]
        return self._watched("get", len(keys), lambda: self._get(client, keys, outs))

    def _get(self, client: Any, keys: Sequence[ChunkKey], outs: list[np.ndarray]) -> list[IOResult]:
        names = self._names(keys)
        return self._by_holders(client, names, lambda at: self._reads.whole(
            client, pick(names, at), pick(keys, at), pick(outs, at)))

    def _by_holders(self, client: Any, names: list[str], read: Read) -> list[IOResult]:
        results, unblamed = self._holders.read(client, names, read)  # (``mooncake_holders``)
        if unblamed is not None:
            self._failed("get", ConnectionError(unblamed.detail))
        return results

    def _watched(self, what: str, count: int, call: Callable[[], list[IOResult]]) -> list[IOResult]:
        """``call()`` on a watched thread (``WatchedCalls``): past ``timeout_s`` the tier is
        out of service at once; the call, which moves bytes of caller memory, is waited for."""
        failures = self.failures
        try:
            results = self._calls.run(what, call, holds_memory=True)
        except CallsBusy as exc:  # this call alone
            return [self._busy(what, exc)] * count
        except Exception as exc:
            return [self._failed(what, exc)] * count
        if results is None:
            return [self._out_of_service()] * count
        self._answered(failures)
        return results

    def get_parts(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray],
                  wanted: Sequence[Collection[int]]) -> list[IOResult]:
        """Ranged reads (``mooncake_ranges``) of the chunks that need only some parts and lie
        in registered memory; the others are read whole."""
        outs = [dst.reshape(-1).view(np.uint8) if dst.flags.c_contiguous else dst for dst in dsts]
        alone = [i for i, (out, parts) in enumerate(zip(outs, wanted, strict=True))
                 if self._format.reads_alone(parts) and out.flags.c_contiguous
                 and out.nbytes >= self.raw_bytes and self._memory.direct(out)]
        if not alone:
            return self.get_many(keys, dsts)
        results: list[IOResult | None] = [None] * len(keys)
        whole = [i for i in range(len(keys)) if i not in set(alone)]
        got = self.get_many(pick(keys, whole), pick(dsts, whole)) if whole else []
        ranged = self._get_ranges(pick(keys, alone), pick(outs, alone), pick(wanted, alone))
        for i, result in [*zip(whole, got, strict=True), *zip(alone, ranged, strict=True)]:
            results[i] = result
        return [r for r in results if r is not None]

    def _get_ranges(self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray],
                    wanted: Sequence[Collection[int]]) -> list[IOResult]:
        client = self._ready("get")
        if isinstance(client, IOResult):
            return [client] * len(keys)
        return self._watched("get", len(keys), lambda: self._read_ranges(client, keys, outs, wanted))

    def _read_ranges(self, client: Any, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray],
                     wanted: Sequence[Collection[int]]) -> list[IOResult]:
        names = self._names(keys)
        return self._by_holders(client, names, lambda at: self._reads.ranges(
            client, pick(names, at), pick(keys, at), pick(outs, at), pick(wanted, at)))

    def put_many(self, items: Sequence[tuple[ChunkKey, np.ndarray]]) -> list[IOResult]:
        wrong = [raw.nbytes for _, raw in items if raw.nbytes != self.raw_bytes]
        if wrong:
            return [IOResult(IOStatus.IO_ERROR, 0, f"a payload of {wrong[0]} bytes: this tier's "
                             f"chunks have {self.raw_bytes}")] * len(items)
        client = self._ready("put")
        if isinstance(client, IOResult):
            return [client] * len(items)
        raws = [np.ascontiguousarray(payload).reshape(-1).view(np.uint8) for _, payload in items]
        return self._watched("put", len(items), lambda: self._put(client, [k for k, _ in items], raws))

    def _put(self, client: Any, keys: list[ChunkKey], raws: list[np.ndarray]) -> list[IOResult]:
        headers, payloads, staged = self._memory.pieces(client, raws)
        fill_pieces(self._format, keys, raws, headers, payloads, staged)
        codes = client.batch_put_from_multi_buffers(
            self._names(keys),
            [[h.ctypes.data, p.ctypes.data] for h, p in zip(headers, payloads, strict=True)],
            [[self._hb, self.raw_bytes]] * len(keys))
        failed = self._trip_failed("put", codes)
        return [failed if failed is not None and code in (RPC_FAIL, RPC_TIMEOUT)
                else put_result(code, self.raw_bytes) for code in codes]

    def nodes_out(self) -> list[str]:
        return self._holders.outages.names()  # holders out of service alone, by endpoint

    def close(self) -> None:
        super().close()
        with self._lock:
            client, self._client = self._client, None
        self._calls.close(None if client is None else client.close)  # once no call runs
