"""KVStore against a model, over random operation sequences (hypothesis stateful).

Complements ``test_store_properties`` (host + disk, restarts, crashes): here a device pool
(the CPU stand-in) may sit above host memory, gets go into fresh tensors, ``empty_kv``
tensors (read into directly from disk) and short tensors, slot files are corrupted on disk,
the I/O engine is held (a hung drive, with a small ``load_timeout``), and the drive fails
(EIO from every read and write of a slot file).

What is checked, after every step (only what docs/standalone.md and the docstrings promise):

- a get never returns wrong bytes: ``out[:, :, :n]`` is ``make_kv(tokens)[:, :, :n]``;
- with no fault in play (no failing drive, no drive that may hang, no corrupted chunk in
  the prefix), a get returns exactly what the lookup just before it said, and a put of no
  more chunks than each memory tier holds, none of them on disk only, leaves the whole
  prefix cached;
- per call, chunks_stored, chunks_loaded and chunks_missed move by what it returned;
- once the engine's background writes are over, no pin and no reservation is left;
- a true ``flush()`` means every chunk held is on disk, and a restart right after it finds
  every chunk, serving each prefix at least as far as before;
- counters never go negative nor, within one store's life, backwards.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier import KVLayout, KVStore
from kvtier.io.buffers import align_up
from kvtier.io.format import HEADER_BYTES
from kvtier.tiers.base import TierName
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, background_writes, bookkeeping, make_kv, same_bytes

GPU, HOST, DISK = TierName.GPU, TierName.HOST, TierName.DISK
# A chunk's part of a row is one page here (16 tokens x 128 lanes x 2 bytes): gets into
# ``empty_kv`` tensors read disk chunks straight into them. SMALL's is a quarter page: never.
DIRECT = KVLayout(num_layers=2, kv_heads=2, head_size=64, dtype="bfloat16")
MAX_CHUNKS = 6
LOAD_TIMEOUT = 0.25


def seq(start: int, chunks: int) -> list[int]:
    return list(range(start, start + chunks * CHUNK))


# Families sharing first chunks, so that prefixes overlap: 21 distinct chunks in all.
FAMILIES = [
    seq(0, MAX_CHUNKS),
    seq(0, 2) + seq(50_000, MAX_CHUNKS - 2),
    seq(0, 1) + seq(60_000, MAX_CHUNKS - 1),
    seq(70_000, MAX_CHUNKS),
]
PREFIXES = st.tuples(st.integers(0, len(FAMILIES) - 1), st.integers(1, MAX_CHUNKS),
                     st.sampled_from([0, 5]))
# counters that only grow within one store's life
GROWING = ("chunks_stored", "chunks_skipped", "chunks_missed", "chunks_promoted", "demotions",
           "drops", "disk_writes", "disk_write_bytes", "disk_reads", "disk_read_bytes",
           "dropped_writes", "corruptions", "io_errors", "load_timeouts", "no_space")


def logged(function):
    """Record each step in the machine's history; an assertion that fails tells it (a
    failure that depends on timing is not replayed by hypothesis, so it shows no steps)."""

    @functools.wraps(function)
    def step(self, **kwargs):
        shown = {k: v for k, v in kwargs.items() if k != "data"}
        self.history.append(f"{function.__name__}({shown})")
        try:
            return function(self, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nsteps:\n  " + "\n  ".join(self.history)) from exc

    return step


class FailingDrive:
    """While ``on``, every ``os.preadv``/``os.pwritev`` of a slot file raises EIO (inside the
    I/O jobs, as a failing drive would)."""

    def __init__(self) -> None:
        self.on = False
        self._real: tuple | None = None

    def install(self) -> None:
        self._real = real_read, real_write = os.preadv, os.pwritev
        os.preadv = lambda fd, *a: self._check(fd) or real_read(fd, *a)
        os.pwritev = lambda fd, *a: self._check(fd) or real_write(fd, *a)

    def uninstall(self) -> None:
        if self._real is not None:
            os.preadv, os.pwritev = self._real
            self._real = None

    def _check(self, fd: int) -> None:
        if self.on and "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "injected I/O error")


class KVStoreMachine(RuleBasedStateMachine):
    faults = True  # corrupt slot files, hold the engine, fail the drive
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvtier-sm-")
        self.store: KVStore | None = None
        self.held = False  # the engine's queues are held (a hung drive)
        self.failing = False  # the drive fails (``FailingDrive``)
        self.hangs = False  # the engine may be held: a short load_timeout
        self.suspect: set[bytes] = set()  # keys whose disk copy was corrupted, ever
        self.prefixes: set[tuple[int, ...]] = set()  # every token sequence put
        self.direct_outs: dict[int, torch.Tensor] = {}  # empty_kv tensors kept for reuse
        self.last_stats = None
        self.drive = FailingDrive()
        self.history: list[str] = []

    # -- set-up -------------------------------------------------------------------------

    @initialize(gpu=st.integers(0, 3), host=st.integers(2, 4), disk=st.integers(4, 12),
                 policy=st.sampled_from(["write_through", "write_back"]),
                 direct=st.booleans(), retry=st.sampled_from([30.0, 0.2]), hangs=st.booleans())
    @logged
    def setup(self, gpu, host, disk, policy, direct, retry, hangs):
        # A drive that may hang needs a short load_timeout (each hang is waited out); with
        # it, a put or get on a busy machine may give up waiting for background writes that
        # hold host slots (documented), so lengths are checked only with the default one.
        self.hangs = hangs and self.faults
        self.layout = DIRECT if direct else SMALL
        chunk_bytes = self.layout.token_bytes * CHUNK
        slot = align_up(chunk_bytes)
        self.cfg = {"chunk_tokens": CHUNK, "gpu_capacity": gpu * slot,
                    "host_capacity": host * slot, "disk_paths": [self.root],
                    "disk_capacity": disk * (HEADER_BYTES + slot), "disk_min_free": 0,
                    "write_policy": policy, "io_threads": 2,
                    "load_timeout": LOAD_TIMEOUT if self.hangs else 10.0,
                    "disk_retry": retry,  # a path taken out of service is tried again then
                    "model": "state-machine"}
        self.drive.install()
        self.open()
        self.sizes = {name: index.num_slots for name, index in self.indexes().items()}
        assert self.sizes.get(GPU, 0) == gpu and self.sizes[HOST] == host
        assert self.sizes[DISK] == disk

    def open(self) -> None:
        make, engines = FakeEngine.factory()
        self.store = KVStore(self.layout, self.cfg, io_engine=make)
        self.engine = engines[0]
        self.held = False
        self.last_stats = None
        self.direct_outs = {}

    def teardown(self) -> None:
        try:
            self.drive.on = False
            if self.store is not None:
                self.engine.release()
                assert self.store.close(timeout=30), "close timed out"
        finally:
            self.drive.uninstall()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------

    def indexes(self):
        with bookkeeping(self.store) as stack:
            return dict(stack.indexes)

    def keys_in(self, tier: TierName) -> set[bytes]:
        with bookkeeping(self.store) as stack:
            return set(stack.indexes[tier].keys())

    def held_keys(self) -> set[bytes]:
        with bookkeeping(self.store) as stack:
            return set().union(*(index.keys() for index in stack.indexes.values()))

    def tokens(self, prefix) -> list[int]:
        family, chunks, tail = prefix
        return FAMILIES[family][: chunks * CHUNK + tail]

    def kv(self, tokens) -> torch.Tensor:
        return make_kv(tokens, self.layout)

    def faulty(self) -> bool:
        """A fault is in play, or may be (a short load_timeout: see ``setup``)."""
        return self.held or self.failing or self.hangs

    def clean(self, tokens) -> bool:
        """No fault can shorten what a get of ``tokens`` serves."""
        return not self.faulty() and not (set(self.store.keys(tokens)) & self.suspect)

    def settle(self) -> None:
        """Wait (bounded) until the engine ran every job and no background write is left."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.engine.drain(timeout=5)
            if self.engine.pending() == 0 and background_writes(self.store) == 0:
                return
            time.sleep(0.01)
        raise AssertionError("background I/O never settled")

    def read(self, tokens, kind: str, out_chunks: int | None) -> tuple[int, torch.Tensor]:
        size = len(tokens) if out_chunks is None else min(len(tokens), out_chunks * CHUNK)
        size = max(size, 1)
        shape = self.layout.shape(size)
        dtype = getattr(torch, self.layout.dtype)
        if kind == "zeros":
            out = torch.zeros(shape, dtype=dtype)
        elif kind == "empty":
            out = torch.empty(shape, dtype=dtype)
        elif kind == "empty_kv":
            out = self.store.empty_kv(size)
        else:  # one empty_kv tensor per size, reused between gets
            out = self.direct_outs.get(size)
            if out is None:
                out = self.direct_outs[size] = self.store.empty_kv(size)
        before = self.store.stats()
        n = self.store.get(tokens, out)
        assert n % CHUNK == 0 and 0 <= n <= size, f"get returned {n} of {size} tokens"
        after, wanted = self.store.stats(), min(len(tokens), size) // CHUNK
        loaded = after.chunks_loaded.total() - before.chunks_loaded.total()
        assert loaded == n // CHUNK, f"get returned {n // CHUNK} chunks, chunks_loaded grew {loaded}"
        assert after.chunks_missed - before.chunks_missed == wanted - n // CHUNK, "chunks_missed"
        want = self.kv(tokens)[:, :, :n]
        assert same_bytes(out[:, :, :n], want), f"wrong bytes served ({kind}, {n} tokens)"
        return n, out

    # -- rules --------------------------------------------------------------------------

    @rule(prefix=PREFIXES)
    @logged
    def put(self, prefix):
        tokens = self.tokens(prefix)
        keys = self.store.keys(tokens)
        with bookkeeping(self.store) as stack:  # chunks of the prefix only the disk holds
            disk_only = [k for k in keys if (loc := stack.locate(k)) and loc.tier is DISK]
        started = time.monotonic()
        stored = self.store.stats().chunks_stored
        n = self.store.put(tokens, self.kv(tokens))
        assert time.monotonic() - started < 15, "put hung"
        assert self.store.stats().chunks_stored - stored == n // CHUNK, "chunks_stored"
        assert n % CHUNK == 0 and 0 <= n <= len(keys) * CHUNK
        self.prefixes.add(tuple(tokens))
        self.history.append(f"  -> put {n // CHUNK} of {len(keys)}; {self.store.stats()}")
        # What must hold: a prefix no longer than any memory tier, none of it on disk only
        # (a put only marks those recent, and under write-through the put's own writes and
        # the disk copies of the host chunks it evicts, touched, are more recent still: the
        # disk may evict them), ends up wholly cached.
        if not self.faulty() and not self.store.stats().paths_down \
                and not disk_only and len(keys) <= min(self.sizes[t] for t in (GPU, HOST) if t in self.sizes):
            got = self.store.lookup(tokens).tokens
            assert got == len(keys) * CHUNK, f"a put of {len(keys)} chunks left {got // CHUNK} cached"

    @rule(prefix=PREFIXES, kind=st.sampled_from(["zeros", "empty", "empty_kv", "reused"]),
          out_chunks=st.none() | st.integers(0, MAX_CHUNKS))
    @logged
    def get(self, prefix, kind, out_chunks):
        tokens = self.tokens(prefix)
        clean = self.clean(tokens)
        expected = self.store.lookup(tokens).tokens
        started = time.monotonic()
        n, _ = self.read(tokens, kind, out_chunks)
        assert time.monotonic() - started < 15, "get hung"
        if out_chunks is not None:
            expected = min(expected, out_chunks * CHUNK)
        if clean:
            assert n == expected, f"get served {n} tokens, lookup said {expected}"

    @rule(prefix=PREFIXES)
    @logged
    def lookup(self, prefix):
        tokens = self.tokens(prefix)
        hit = self.store.lookup(tokens)
        assert hit.tokens % CHUNK == 0 and 0 <= hit.tokens <= len(tokens)
        assert sum(hit.chunks_by_tier.values()) * CHUNK == hit.tokens
        assert set(hit.chunks_by_tier) <= set(self.sizes)

    @rule()
    @logged
    def flush(self):
        timeout = 1.0 if self.faulty() else 30.0
        before = self.held_keys()
        started = time.monotonic()
        result = self.store.flush(timeout=timeout)
        took = time.monotonic() - started
        assert took < timeout + 2 * LOAD_TIMEOUT + 3, f"flush({timeout}) took {took:.1f} s"
        assert result.written >= 0 and result.not_written >= 0
        if result:
            held, on_disk = self.held_keys(), self.keys_in(DISK)
            assert held <= on_disk, f"flush() was true with {len(held - on_disk)} chunks not on disk"
        elif not self.faulty() and not self.store.stats().paths_down and len(before) <= self.sizes[DISK]:
            raise AssertionError(f"flush() false with every chunk fitting on disk: {result}")

    @precondition(lambda self: not self.held)
    @rule(flush_first=st.booleans())
    @logged
    def restart(self, flush_first):
        served: dict[tuple[int, ...], int] = {}
        durable = False
        if flush_first:
            result = self.store.flush(timeout=1.0 if self.failing else 30.0)
            if result:
                durable, held = True, self.held_keys()
                assert held <= self.keys_in(DISK)
                served = {p: self.store.lookup(list(p)).tokens for p in self.prefixes}
        self.engine.release()
        assert self.store.close(timeout=30), "close timed out"
        self.open()
        if durable:
            found = self.keys_in(DISK)
            lost = held - found
            assert not lost - self.suspect, f"{len(lost)} flushed chunks not found after a restart"
            for tokens, before in served.items():
                if self.clean(list(tokens)):
                    assert self.store.lookup(list(tokens)).tokens >= before, "prefix lost"

    @precondition(lambda self: self.faults)
    @rule(pick=st.integers(0, 63), header=st.booleans(), where=st.integers(0, 2**20))
    @logged
    def corrupt(self, pick, header, where):
        """Flip one byte of a chunk's slot on disk: its header or its payload. (Drawn before
        looking at the disk: what it holds may depend on the timing of background writes.)"""
        with bookkeeping(self.store) as stack:
            disk = stack.indexes[DISK]
            held = disk.keys()
            on_disk = sorted((slot, key) for key in held if (slot := disk.slot_of(key)) is not None)
        if not on_disk:
            return
        slot, key = on_disk[pick % len(on_disk)]
        _, directory, number, offset = self.store.disk._where(slot)
        if directory is None:
            return
        where = where % 128 if header else HEADER_BYTES + where % (self.layout.token_bytes * CHUNK)
        path = Path(directory.path) / f"slots-{number:04d}.kvt"
        with open(path, "r+b") as f:
            f.seek(offset + where)
            byte = f.read(1)
            if len(byte) != 1:
                return
            f.seek(offset + where)
            f.write(bytes([byte[0] ^ 0x5A]))
        self.suspect.add(key)

    @precondition(lambda self: self.hangs and not self.held)
    @rule()
    @logged
    def hold(self):
        self.engine.hold()
        self.held = True

    @precondition(lambda self: self.held)
    @rule()
    @logged
    def release(self):
        self.engine.release()
        self.held = False

    @precondition(lambda self: self.faults)
    @rule(on=st.booleans())
    @logged
    def fail(self, on):
        """The drive fails (EIO on every read and write of a slot file), or works again."""
        self.drive.on = on
        self.failing = on

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def no_pins_nor_reservations_once_io_is_over(self):
        if self.store is None or self.held:
            return  # a hung drive's writes keep their slots until they end (documented)
        self.settle()
        # A job's done callbacks (the reservations of a write given up on) run just after
        # the engine counts it over: give them a moment.
        deadline = time.monotonic() + 3
        while (problems := self.bookkeeping_problems()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not problems, f"{problems}\nsteps:\n  " + "\n  ".join(self.history)

    def bookkeeping_problems(self) -> list[str]:
        problems = []
        with bookkeeping(self.store) as stack:
            for name, index in stack.indexes.items():
                census = index.census()
                if census.pins or census.writing or census.doomed:
                    problems.append(f"{name}: left {census}")
                # white-box: every slot is free, held by one entry, or retired (a path down)
                held = [entry.slot for entry in index._entries.values()]
                free = {s for s in range(index.num_slots) if index._is_free[s]}
                retired = {s for s in range(index.num_slots) if index._retired[s]}
                if len(held) != len(set(held)):
                    problems.append(f"{name}: a slot held twice")
                if free & set(held) or free & retired or index.free_slots != len(free):
                    problems.append(f"{name}: a slot free and held")
                if free | set(held) | retired != set(range(index.num_slots)):
                    problems.append(f"{name}: slot leaked")
        return problems

    @invariant()
    def counters_never_negative_nor_backwards(self):
        if self.store is None:
            return
        stats = self.store.stats()
        for name in GROWING:
            assert getattr(stats, name) >= 0, f"{name} = {getattr(stats, name)}"
        assert all(v >= 0 for v in stats.chunks_loaded.values()), stats.chunks_loaded
        assert all(v >= 0 for v in stats.evictions.values()), stats.evictions
        if self.last_stats is not None:
            for name in GROWING:
                assert getattr(stats, name) >= getattr(self.last_stats, name), f"{name} went down"
            for tier, v in self.last_stats.chunks_loaded.items():
                assert stats.chunks_loaded[tier] >= v, f"chunks_loaded[{tier}] went down"
            for tier, v in self.last_stats.evictions.items():
                assert stats.evictions.get(tier, 0) >= v, f"evictions[{tier}] went down"
        self.last_stats = stats


# 10-30 s for the file on 2 busy cores (the fault machine waits out load_timeout whenever the
# engine is held). Explore further with STATE_MACHINE_EXAMPLES=400 in the environment.
SETTINGS = settings(max_examples=int(os.environ.get("STATE_MACHINE_EXAMPLES", "40")),
                    stateful_step_count=25, deadline=None, database=None,
                    phases=[p for p in Phase if p is not Phase.explain],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])



class NoFaultMachine(KVStoreMachine):
    """No fault at all: every get must serve what lookup said, every flush be true when
    the chunks fit on disk."""

    faults = False


TestKVStoreMachine = KVStoreMachine.TestCase
TestKVStoreMachine.settings = SETTINGS
TestNoFaultMachine = NoFaultMachine.TestCase
TestNoFaultMachine.settings = settings(SETTINGS, max_examples=80)


# -- bugs found by the machine above --------------------------------------------


def _config(root, **extra):
    return {"chunk_tokens": CHUNK, "host_capacity": 2 * CHUNK_BYTES, "disk_paths": [str(root)],
            "disk_capacity": 4 * (HEADER_BYTES + CHUNK_BYTES), "disk_min_free": 0,
            "io_threads": 2, "model": "state-machine", **extra}


def test_a_put_keeps_every_chunk_while_host_slots_are_held_by_writes(tmp_path):
    """gpu 1 slot, host 2, disk 4, write-through on a slow drive: chunks 0 and 1 reach host
    memory and their writes pin both host slots; chunk 3's demotion of chunk 2 finds no
    host slot and goes straight to disk. It was dropped: put() said 4 chunks were stored
    and only 3 were cached (with the production engine on a fast disk, in most fresh
    stores)."""
    make, engines = FakeEngine.factory()
    tokens = seq(0, 4)
    cfg = _config(tmp_path, gpu_capacity=CHUNK_BYTES, write_policy="write_through")
    with KVStore(SMALL, cfg, io_engine=make) as store:
        engines[0].hold()
        while_held = threading.Thread(target=_release_once_waited_on, args=(engines[0],))
        while_held.start()
        try:
            assert store.put(tokens, make_kv(tokens)) == 4 * CHUNK
        finally:
            engines[0].release()
            while_held.join()
        assert engines[0].drain(timeout=10)
        assert store.stats().drops == 0
        assert store.lookup(tokens).tokens == 4 * CHUNK
        with bookkeeping(store) as stack:
            assert stack.indexes[DISK].slot_of(store.keys(tokens)[2]) is not None
        out = store.empty_kv(4 * CHUNK)
        assert store.get(tokens, out) == 4 * CHUNK
        assert same_bytes(out, make_kv(tokens))


def _release_once_waited_on(engine: FakeEngine) -> None:
    """A slow drive: release ``engine``'s held jobs once three of them wait (the two
    write-through writes, and then a third job), or after 2 s."""
    for _ in range(3):
        if not engine.started.acquire(timeout=2):
            break
    engine.release()



def test_a_device_pool_victim_never_waits_on_a_hung_drive(tmp_path):
    """Write-through on a hung drive, every host slot held by its write: a device pool's
    victim went to disk while the put waited, load_timeout per chunk, and lost its own
    chunk, its device slot reserved until the hung write ended (never). The victim is now
    written from a copy of its own in the background: puts go on at once, and once the
    drive answers it is on disk."""
    make, engines = FakeEngine.factory()
    cfg = _config(tmp_path, gpu_capacity=2 * CHUNK_BYTES, write_policy="write_through",
                  load_timeout="10s", disk_capacity=16 * (HEADER_BYTES + CHUNK_BYTES))
    with KVStore(SMALL, cfg, io_engine=make) as store:
        engines[0].hold()  # the drive hangs
        try:
            started = time.monotonic()
            assert store.put(seq(0, 4), make_kv(seq(0, 4))) == 4 * CHUNK
            assert store.put(seq(100, 2), make_kv(seq(100, 2))) == 2 * CHUNK
            assert store.put(seq(200, 2), make_kv(seq(200, 2))) == 2 * CHUNK
            assert time.monotonic() - started < 5, "a put waited on the hung drive"
            assert store.lookup(seq(200, 2)).tokens == 2 * CHUNK
        finally:
            engines[0].release()
        assert engines[0].drain(timeout=10)
        assert store.stats().drops == 0 and store.stats().load_timeouts == 0
        for tokens in (seq(0, 4), seq(100, 2), seq(200, 2)):
            out = store.empty_kv(len(tokens))
            assert store.get(tokens, out) == len(tokens) and same_bytes(out, make_kv(tokens))


def test_device_pool_victims_waiting_on_a_hung_drive_are_bounded(tmp_path):
    """The copies waiting to be written are at most ``max_pending``: past that a victim is
    dropped (counted), so a drive that never answers costs bounded memory."""
    make, engines = FakeEngine.factory()
    cfg = _config(tmp_path, gpu_capacity=2 * CHUNK_BYTES, write_policy="write_through",
                  disk_capacity=64 * (HEADER_BYTES + CHUNK_BYTES))
    with KVStore(SMALL, cfg, io_engine=make) as store:
        bound = store._state.max_pending
        engines[0].hold()
        try:
            for i in range(bound + 6):
                assert store.put(seq(1000 * i, 1), make_kv(seq(1000 * i, 1))) == CHUNK
            assert store._runner._behind == bound and store.stats().drops >= 1
        finally:
            engines[0].release()
        assert engines[0].drain(timeout=10)
        assert store._runner._behind == 0
