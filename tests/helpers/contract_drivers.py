"""Two drivers with one small interface over kvtier's two front ends, for tests/test_contract.py.

``StoreDriver`` drives ``kvtier.KVStore`` (``DirectStoreDriver`` the same, loading into
tensors from ``KVStore.empty_kv``, which disk chunks are read straight into);
``ConnectorDriver`` drives the vLLM connector's
``SchedulerSide`` and ``WorkerSide`` directly, round-tripping ``StepPlan`` and
``WorkerReport`` as vLLM would, without an engine. Both use public methods only.

The interface (``Driver``) speaks in token sequences and KV tensors of shape
``(layers, 2, tokens, hidden)`` whose bytes are a pure function of the token prefix
(``expected_kv``).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier import KVLayout, KVStore
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.side import WorkerSide
from kvtier.io.format import HEADER_BYTES

# 2 layers, 2 KV heads x 32 dims, bf16: 128 B per token, layer and K or V; 32-token chunks
# of 16 KiB (a page per layer and K or V: readable straight into a tensor from ``empty_kv``),
# two 16-token engine blocks each on the connector side.
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16")
CHUNK = 32
BLOCK = 16
NUM_BLOCKS = 64  # engine blocks per layer on the connector side
MODEL = "contract-model"
FILL = -1  # int16 pattern of a fresh buffer; expected_kv never produces it
DEADLINE_S = 10.0


def expected_kv(tokens: Sequence[int]) -> torch.Tensor:
    """KV of ``tokens``: ``(layers, 2, len, hidden)`` bf16 whose bytes depend on the whole
    prefix up to each position, on the layer, K or V, and the lane (never ``FILL``)."""
    ids = np.asarray(tokens, dtype=np.int64)
    prefix = np.cumsum((ids + 1) * 2654435761 % 65521) % 65521
    layer = np.arange(LAYOUT.num_layers)[:, None, None, None]
    kv_index = np.arange(2)[None, :, None, None]
    lane = np.arange(LAYOUT.hidden)[None, None, None, :]
    values = prefix[None, None, :, None] * 31 + lane + kv_index * 7 + layer * 13
    # 0..0x3F7F: finite bf16 patterns only, so that equal bytes also compare equal as floats
    as_int16 = torch.from_numpy((values % 0x3F80).astype(np.int16))
    return as_int16.view(torch.bfloat16).contiguous()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                              b.contiguous().view(torch.int16))


@dataclass(frozen=True)
class Loaded:
    """What a load delivered: ``tokens`` leading tokens, their KV in ``kv``."""

    tokens: int
    kv: torch.Tensor


@dataclass
class Settings:
    """What a driver is opened with; ``restart`` may change ``model`` and ``chunk_tokens``."""

    root: Path  # the driver's own scratch directory
    disk: bool = True
    host_chunks: int = 8
    disk_chunks: int = 16
    model: str = MODEL
    chunk_tokens: int = CHUNK

    @property
    def disk_dir(self) -> Path:
        return self.root / "disk"

    def config(self) -> dict:
        chunk_bytes = LAYOUT.token_bytes * self.chunk_tokens
        cfg = {"chunk_tokens": self.chunk_tokens, "host_capacity": self.host_chunks * chunk_bytes,
               "io_threads": 2, "load_policy": "always"}
        if self.disk:
            self.disk_dir.mkdir(mode=0o700, exist_ok=True)
            cfg.update(disk_paths=[str(self.disk_dir)], disk_min_free=0,
                       disk_capacity=self.disk_chunks * (HEADER_BYTES + chunk_bytes))
        return cfg


class Driver(ABC):
    """One front end of kvtier, seen through what both promise.

    - ``store(tokens)`` stores the KV (``expected_kv``) of every full chunk of ``tokens``.
    - ``persist()`` returns once every stored chunk is on disk (fails the test otherwise).
    - ``hit_tokens(tokens)``: how many leading tokens of ``tokens`` a load would deliver now.
    - ``load(tokens)`` loads the cached prefix into a fresh buffer (filled with ``FILL``).
    - ``restart(...)`` closes and opens again on the same directories.
    - ``chunk_key(tokens, k)``: the 16-byte key of chunk ``k``, as its slot header names it.
    """

    name: str

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def chunk_tokens(self) -> int:
        return self.settings.chunk_tokens

    @property
    def disk_dir(self) -> Path:
        return self.settings.disk_dir

    @abstractmethod
    def store(self, tokens: Sequence[int]) -> None: ...

    @abstractmethod
    def persist(self) -> None: ...

    @abstractmethod
    def hit_tokens(self, tokens: Sequence[int]) -> int: ...

    @abstractmethod
    def load(self, tokens: Sequence[int]) -> Loaded: ...

    @abstractmethod
    def chunk_key(self, tokens: Sequence[int], k: int) -> bytes: ...

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def restart(self, *, model: str | None = None, chunk_tokens: int | None = None) -> None:
        self.close()
        if model is not None:
            self.settings.model = model
        if chunk_tokens is not None:
            self.settings.chunk_tokens = chunk_tokens
        self.open()


class StoreDriver(Driver):
    """``KVStore``: put, lookup, get into a tensor we own, flush, close."""

    name = "kvstore"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.kv: KVStore | None = None
        self.open()

    @property
    def _store(self) -> KVStore:
        assert self.kv is not None, "the driver is closed"
        return self.kv

    def open(self) -> None:
        cfg = load_config(self.settings.config(), environ={})
        self.kv = KVStore(LAYOUT, cfg, model=self.settings.model)

    def close(self) -> None:
        if self.kv is not None:
            assert self.kv.close(), "KVStore.close did not finish its disk jobs"
            self.kv = None

    def store(self, tokens: Sequence[int]) -> None:
        self._store.put(list(tokens), expected_kv(tokens))

    def persist(self) -> None:
        result = self._store.flush(timeout=DEADLINE_S)
        assert result, f"flush left chunks off disk: {result}"

    def hit_tokens(self, tokens: Sequence[int]) -> int:
        return self._store.lookup(list(tokens)).tokens

    def load(self, tokens: Sequence[int]) -> Loaded:
        out = torch.full(LAYOUT.shape(len(tokens)), FILL, dtype=torch.int16).view(torch.bfloat16)
        n = self._store.get(list(tokens), out)
        return Loaded(n, out[:, :, :n])

    def chunk_key(self, tokens: Sequence[int], k: int) -> bytes:
        return bytes(self._store.keys(list(tokens))[k])


class DirectStoreDriver(StoreDriver):
    """``KVStore`` loading into a tensor from ``empty_kv``, reused from load to load as a
    serving engine reuses its buffers (filled with ``FILL`` before each load)."""

    name = "kvstore-direct"

    def __init__(self, settings: Settings) -> None:
        self._out: torch.Tensor | None = None
        super().__init__(settings)

    def open(self) -> None:
        super().open()
        self._out = None  # the new store's own buffer

    def load(self, tokens: Sequence[int]) -> Loaded:
        if self._out is None or self._out.shape[2] < len(tokens):
            self._out = self._store.empty_kv(max(len(tokens), 1))
        out = self._out[:, :, :len(tokens)]
        out.view(torch.int16).fill_(FILL)
        n = self._store.get(list(tokens), out)
        return Loaded(n, out[:, :, :n].clone())


@dataclass
class Request:
    """What the scheduler side reads of vLLM's ``Request``."""

    request_id: str
    num_tokens: int
    block_hashes: list[bytes]


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """Chained hashes of the full blocks, as vLLM's prefix cache makes them."""
    hashes, parent = [], b"\0" * 32
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        block = np.asarray(tokens[start:start + BLOCK], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=32).digest()
        hashes.append(parent)
    return hashes


class ConnectorDriver(Driver):
    """``SchedulerSide`` + ``WorkerSide`` of one TP rank, as vLLM drives them each step.

    A store is one step: ``build_meta`` -> ``plan_stores`` -> ``WorkerSide.save`` -> report.
    A lookup asks about a prompt one token longer than ``tokens`` (vLLM always computes a
    prompt's last token, so only then may every full chunk of ``tokens`` hit). A load is
    ``num_new_matched_tokens`` -> ``plan_load`` -> ``build_meta`` -> ``start_loads`` ->
    ``finished``/``take_invalid_blocks`` -> report, into blocks filled with ``FILL``; it
    delivers the blocks before the first one reported invalid (recomputed by vLLM).
    """

    name = "connector"
    _ids = itertools.count()

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.pages: list[torch.Tensor] = []
        self.writing: Counter = Counter()  # disk writes planned and not reported yet
        self.open()

    def open(self) -> None:
        s = self.settings
        cfg = load_config(s.config(), environ={})
        hidden, size = LAYOUT.hidden, torch.finfo(torch.bfloat16).bits // 8
        self.geometry = KVGeometry(
            num_layers=LAYOUT.num_layers, page_bytes=2 * BLOCK * hidden * size, block_tokens=BLOCK,
            hash_block_tokens=BLOCK, chunk_tokens=s.chunk_tokens, kv_dtype=LAYOUT.dtype,
            page_shape=f"{BLOCK}x{LAYOUT.kv_heads}x{LAYOUT.head_size}x{LAYOUT.dtype}")
        namespace = self.geometry.namespace(s.model, "", 1, 0)
        self.scheduler = SchedulerSide(cfg, self.geometry, [namespace], 1)
        self.worker = WorkerSide(cfg, self.geometry, namespace)
        shape = (NUM_BLOCKS, 2, BLOCK, hidden)
        self.pages = [torch.full(shape, FILL, dtype=torch.int16).view(torch.bfloat16)
                      for _ in range(LAYOUT.num_layers)]
        self.worker.register({f"model.layers.{i}.attn": t for i, t in enumerate(self.pages)})
        self.writing = Counter()

    def close(self) -> None:
        if self.worker is not None:
            assert self.worker.close(), "WorkerSide.close did not finish its disk jobs"
            self.pump()  # the writes close waited for
            self._sides[0].close()  # as the connector's shutdown
            self.worker = self.scheduler = None

    @property
    def _sides(self) -> tuple[SchedulerSide, WorkerSide]:
        assert self.scheduler is not None and self.worker is not None, "the driver is closed"
        return self.scheduler, self.worker

    def _request(self, tokens: Sequence[int], num_tokens: int) -> Request:
        return Request(f"req-{next(self._ids)}", num_tokens, block_hashes(tokens))

    def _query(self, tokens: Sequence[int]) -> Request:
        prompt = [*tokens, 7]  # one more token: the one vLLM computes anyway
        return self._request(prompt, len(prompt))

    def pump(self) -> None:
        """Hand the worker's report (if any) to the scheduler, as vLLM does each step."""
        scheduler, worker = self._sides
        report = worker.report()
        if report is None:
            return
        self.writing.subtract(report.disk_written + report.disk_failed)
        self.writing = +self.writing
        scheduler.worker_report(report)

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.002)

    def store(self, tokens: Sequence[int]) -> None:
        scheduler, worker = self._sides
        full = len(tokens) // BLOCK
        block_ids = list(range(1, full + 1))  # block 0 is vLLM's null block
        kv = expected_kv(tokens)
        for layer, pages in enumerate(self.pages):  # the forward pass writes the pages
            for i, b in enumerate(block_ids):
                pages[b].copy_(kv[layer, :, i * BLOCK:(i + 1) * BLOCK])
        req = self._request(tokens, len(tokens))
        meta = scheduler.build_meta()
        scheduler.plan_stores(req, (block_ids,), len(tokens), meta)
        worker.start_loads(meta)
        worker.save(meta)
        self.writing.update(s.key for s in meta.stores if s.disk_slot is not None)
        self.pump()
        scheduler.request_finished(req.request_id)

    def persist(self) -> None:
        def written() -> bool:
            self.pump()
            return not self.writing

        self._wait(written, f"disk writes never reported: {self.writing}")

    def _match(self, req: Request) -> tuple[int, bool]:
        """``num_new_matched_tokens``, asked again while it says "ask again next step"."""
        scheduler, _ = self._sides
        deadline = time.monotonic() + DEADLINE_S
        while True:
            n, from_disk = scheduler.num_new_matched_tokens(req, 0)
            if n is not None:
                return n, from_disk
            assert time.monotonic() < deadline, "the scheduler side kept saying: ask again"
            self.pump()
            time.sleep(0.002)

    def hit_tokens(self, tokens: Sequence[int]) -> int:
        scheduler, _ = self._sides
        req = self._query(tokens)
        n, _ = self._match(req)
        scheduler.request_finished(req.request_id)
        return n

    def load(self, tokens: Sequence[int]) -> Loaded:
        scheduler, worker = self._sides
        req = self._query(tokens)
        n, from_disk = self._match(req)
        if n == 0:
            scheduler.request_finished(req.request_id)
            return Loaded(0, expected_kv([])[:, :, :0])
        assert n % BLOCK == 0, n
        first = NUM_BLOCKS // 2  # fresh blocks, never those the stores used
        block_ids = list(range(first, first + -(-req.num_tokens // BLOCK)))
        for pages in self.pages:
            pages[first:].view(torch.int16).fill_(FILL)
        scheduler.plan_load(req, (block_ids,), 0, n)
        meta = scheduler.build_meta()
        worker.start_loads(meta)
        if from_disk:
            done: set[str] = set()
            self._wait(lambda: bool(done.update(worker.finished())) or req.request_id in done,
                       "an asynchronous load was never reported finished")
        else:
            assert req.request_id not in worker.finished()  # over before the forward
        invalid = worker.take_invalid_blocks()
        self.pump()
        assert scheduler.request_finished(req.request_id) is False  # nothing left running
        planned = block_ids[: n // BLOCK]
        good = next((i for i, b in enumerate(planned) if b in invalid), len(planned))
        assert invalid == set(planned[good:]), (
            f"blocks reported for recompute {sorted(invalid)} are not a suffix of {planned}")
        kv = torch.cat([torch.stack([p[b] for p in self.pages]) for b in planned[:good]], dim=2) \
            if good else expected_kv([])[:, :, :0]
        return Loaded(good * BLOCK, kv)

    def chunk_key(self, tokens: Sequence[int], k: int) -> bytes:
        scheduler, _ = self._sides
        return bytes(scheduler.chunk_keys(self._request(tokens, len(tokens)), k + 1)[k])


DRIVERS: dict[str, type[Driver]] = {"kvstore": StoreDriver, "kvstore-direct": DirectStoreDriver,
                                     "connector": ConnectorDriver}
