"""What ``KVStore`` and the vLLM connector both promise, run against both.

Every test takes a ``driver`` (tests/helpers/contract_drivers.py): the same token sequences, the same
known KV, the same faults on the real slot files, through either front end.

- A hit is a prefix of whole chunks of a stored sequence; loaded bytes are the stored bytes.
- A chunk whose read fails (corrupt bytes, EIO) is recomputed with every later one, never
  served wrong, and dropped, so the next lookup does not offer it.
- Chunks on disk survive a restart on the same directory, model and chunk size; nothing else
  does.
- Storing more than fits stays within the capacities and never serves wrong bytes.

The one designed difference is stated where it shows: in vLLM a load is cut to the host
slots free to stage it, where ``KVStore`` streams a get through host memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvtier.io.format import HeaderError, decode_header
from tests.helpers.contract_drivers import (
    CHUNK,
    DRIVERS,
    HEADER_BYTES,
    LAYOUT,
    MODEL,
    Driver,
    Settings,
    expected_kv,
    same_bytes,
)

# -- faults on the real files ------------------------------------------------------------


@dataclass(frozen=True)
class SlotPlace:
    """Where a chunk's slot is: its slot file and the header's byte offset in it."""

    file: Path
    offset: int


def find_slots(disk_dir: Path, key: bytes) -> list[SlotPlace]:
    """Every slot on disk whose valid header names ``key`` (the layout of docs/disk.md:
    fixed-size slots in ``<path>/<namespace>/slots-NNNN.kvt``, each a 4 KiB header and its
    payload padded to 4 KiB)."""
    found = []
    for file in sorted(disk_dir.glob("*/writers/*/slots-*.kvt")):
        data = file.read_bytes()
        for offset in range(0, len(data) - HEADER_BYTES + 1, HEADER_BYTES):
            try:
                header = decode_header(data[offset:offset + HEADER_BYTES])
            except HeaderError:
                continue
            if bytes(header.key) == key:
                found.append(SlotPlace(file, offset))
    return found


PAYLOAD = HEADER_BYTES  # a slot's payload starts after its header
GENERATION = 48  # the header's write counter (docs/disk.md, "Slot header")


def flip_bytes(place: SlotPlace, at: int = PAYLOAD + 100, count: int = 8) -> None:
    """Flip ``count`` bytes of the slot file, ``at`` bytes into the slot, on disk."""
    with open(place.file, "r+b") as f:
        f.seek(place.offset + at)
        data = f.read(count)
        f.seek(place.offset + at)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def eio_on(monkeypatch, place: SlotPlace) -> Iterator[list[int]]:
    """Make every ``os.preadv`` whose range covers the slot's header fail with EIO, as a bad
    sector there would; yields the offsets of the calls that failed."""
    real = os.preadv
    failed: list[int] = []
    target = os.path.realpath(place.file)

    def preadv(fd, buffers, offset, *args):
        length = sum(memoryview(b).nbytes for b in buffers)
        if offset <= place.offset < offset + length and \
                os.path.realpath(f"/proc/self/fd/{fd}") == target:
            failed.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    try:
        yield failed
    finally:
        monkeypatch.setattr(os, "preadv", real)


def disk_bytes(disk_dir: Path) -> int:
    """Bytes the slot files take (apparent size)."""
    return sum(f.stat().st_size for f in disk_dir.glob("*/writers/*/slots-*.kvt"))


# -- drivers --------------------------------------------------------------------------------


def tokens_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, size=n).tolist()


@pytest.fixture(params=sorted(DRIVERS))
def open_driver(request, tmp_path):
    """Opens drivers of this run's front end (each in its own directory); closes them after."""
    opened: list[Driver] = []

    def open_(**settings) -> Driver:
        root = tmp_path / f"driver{len(opened)}"
        root.mkdir()
        driver = DRIVERS[request.param](Settings(root=root, **settings))
        opened.append(driver)
        return driver

    yield open_
    for driver in opened:
        driver.close()


@pytest.fixture
def driver(open_driver) -> Driver:
    return open_driver()


def assert_loads(driver: Driver, tokens: list[int], want_tokens: int) -> None:
    """A load delivers exactly ``want_tokens`` tokens, byte for byte what was stored."""
    loaded = driver.load(tokens)
    assert loaded.tokens == want_tokens
    assert same_bytes(loaded.kv, expected_kv(tokens)[:, :, :want_tokens])


def on_disk_only(driver: Driver, tokens: list[int]) -> None:
    """Store ``tokens``, get every chunk to disk, and restart: nothing left in memory."""
    driver.store(tokens)
    driver.persist()
    driver.restart()
    assert driver.hit_tokens(tokens) == len(tokens) // CHUNK * CHUNK


# -- what a hit is ------------------------------------------------------------------------


def test_stored_chunks_load_back_byte_for_byte(driver):
    tokens = tokens_of(3 * CHUNK + 10)
    driver.store(tokens)
    assert driver.hit_tokens(tokens) == 3 * CHUNK
    assert_loads(driver, tokens, 3 * CHUNK)


@pytest.mark.parametrize("diverge_at", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 20, 4 * CHUNK - 1])
def test_a_sequence_diverging_in_chunk_k_hits_exactly_the_chunks_before_k(driver, diverge_at):
    tokens = tokens_of(4 * CHUNK)
    driver.store(tokens)
    other = list(tokens)
    other[diverge_at] += 1
    hit = diverge_at // CHUNK * CHUNK
    assert driver.hit_tokens(other) == hit
    assert_loads(driver, other, hit)  # the shared prefix's KV: the stored bytes
    assert driver.hit_tokens([*tokens, *tokens_of(CHUNK + 5, seed=1)]) == 4 * CHUNK


def test_a_partial_trailing_chunk_is_not_stored(driver):
    tokens = tokens_of(3 * CHUNK)
    driver.store(tokens[: 2 * CHUNK + 20])
    assert driver.hit_tokens(tokens) == 2 * CHUNK
    assert_loads(driver, tokens, 2 * CHUNK)
    driver.store(tokens)  # the chunk once complete
    assert driver.hit_tokens(tokens) == 3 * CHUNK
    assert_loads(driver, tokens, 3 * CHUNK)


def test_a_sequence_never_stored_does_not_hit(driver):
    driver.store(tokens_of(2 * CHUNK))
    assert driver.hit_tokens(tokens_of(2 * CHUNK, seed=5)) == 0
    assert driver.load(tokens_of(2 * CHUNK, seed=5)).tokens == 0


# -- what a failed read becomes -----------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 2, 3])
def test_a_corrupt_chunk_is_recomputed_with_every_later_one_and_dropped(driver, bad):
    tokens = tokens_of(4 * CHUNK)
    on_disk_only(driver, tokens)
    (place,) = find_slots(driver.disk_dir, driver.chunk_key(tokens, bad))
    flip_bytes(place)
    assert driver.hit_tokens(tokens) == 4 * CHUNK  # nothing has read it yet
    assert_loads(driver, tokens, bad * CHUNK)
    assert driver.hit_tokens(tokens) == bad * CHUNK  # not offered again
    driver.store(tokens)  # computed again, stored again
    assert driver.hit_tokens(tokens) == 4 * CHUNK
    assert_loads(driver, tokens, 4 * CHUNK)


def test_a_corrupt_chunk_stays_dropped_after_a_restart(driver):
    tokens = tokens_of(4 * CHUNK)
    on_disk_only(driver, tokens)
    (place,) = find_slots(driver.disk_dir, driver.chunk_key(tokens, 1))
    flip_bytes(place)
    assert_loads(driver, tokens, CHUNK)
    driver.restart()
    assert driver.hit_tokens(tokens) == CHUNK


def test_a_corrupt_header_is_a_miss(driver):
    tokens = tokens_of(3 * CHUNK)
    on_disk_only(driver, tokens)
    (place,) = find_slots(driver.disk_dir, driver.chunk_key(tokens, 1))
    flip_bytes(place, at=GENERATION)  # the header's checksum no longer matches
    assert_loads(driver, tokens, CHUNK)
    assert driver.hit_tokens(tokens) == CHUNK


@pytest.mark.parametrize("bad", [0, 1, 3])
def test_an_eio_read_is_recomputed_with_every_later_one_and_dropped(driver, monkeypatch, bad):
    tokens = tokens_of(4 * CHUNK)
    on_disk_only(driver, tokens)
    (place,) = find_slots(driver.disk_dir, driver.chunk_key(tokens, bad))
    with eio_on(monkeypatch, place) as failed:
        assert_loads(driver, tokens, bad * CHUNK)
    assert failed, "the bad chunk was never read"
    assert driver.hit_tokens(tokens) == bad * CHUNK  # not offered again
    driver.store(tokens)
    assert_loads(driver, tokens, 4 * CHUNK)


# -- what survives a restart --------------------------------------------------------------


def test_chunks_on_disk_survive_a_restart(driver):
    tokens = tokens_of(3 * CHUNK + 7)
    driver.store(tokens)
    driver.persist()
    driver.restart()
    assert driver.hit_tokens(tokens) == 3 * CHUNK
    assert_loads(driver, tokens, 3 * CHUNK)  # read from disk: nothing else holds them now


def test_host_only_chunks_do_not_survive_a_restart(open_driver):
    driver = open_driver(disk=False)
    tokens = tokens_of(2 * CHUNK)
    driver.store(tokens)
    assert driver.hit_tokens(tokens) == 2 * CHUNK
    driver.restart()
    assert driver.hit_tokens(tokens) == 0
    assert driver.load(tokens).tokens == 0


@pytest.mark.parametrize("change", [{"model": "another-model"}, {"chunk_tokens": 2 * CHUNK}],
                         ids=["model", "chunk_tokens"])
def test_another_model_or_chunk_size_does_not_hit(driver, change):
    tokens = tokens_of(4 * CHUNK)
    driver.store(tokens)
    driver.persist()
    driver.restart(**change)
    assert driver.hit_tokens(tokens) == 0
    assert driver.load(tokens).tokens == 0
    driver.restart(model=MODEL, chunk_tokens=CHUNK)  # they were there all along
    assert driver.hit_tokens(tokens) == 4 * CHUNK
    assert_loads(driver, tokens, 4 * CHUNK)


# -- eviction -----------------------------------------------------------------------------


def test_storing_more_than_fits_stays_bounded_and_never_serves_wrong_bytes(open_driver):
    host, disk = 4, 8
    driver = open_driver(host_chunks=host, disk_chunks=disk)
    sequences = [tokens_of(2 * CHUNK, seed=100 + i) for i in range(10)]  # 20 chunks
    for tokens in sequences:
        driver.store(tokens)
        driver.persist()
    assert driver.hit_tokens(sequences[-1]) == 2 * CHUNK  # the newest stays
    hits = [driver.hit_tokens(tokens) for tokens in sequences]
    assert sum(hits) <= (host + disk) * CHUNK
    assert disk_bytes(driver.disk_dir) <= disk * (HEADER_BYTES + LAYOUT.token_bytes * CHUNK)
    for tokens, hit in zip(sequences, hits, strict=True):
        loaded = driver.load(tokens)
        assert loaded.tokens <= hit
        assert same_bytes(loaded.kv, expected_kv(tokens)[:, :, :loaded.tokens])
    driver.restart()
    hits = [driver.hit_tokens(tokens) for tokens in sequences]
    assert 0 < sum(hits) <= disk * CHUNK
    for tokens, hit in zip(sequences, hits, strict=True):
        loaded = driver.load(tokens)
        assert loaded.tokens <= hit
        assert same_bytes(loaded.kv, expected_kv(tokens)[:, :, :loaded.tokens])


def test_a_prefix_larger_than_host_memory_is_streamed_or_cut_to_the_staging_slots(open_driver):
    """KVStore streams a get through host memory; in vLLM every disk chunk of a load holds
    a host staging slot for the whole load, so the match is cut to the slots free
    (docs/architecture.md, 'In vLLM'). Either way, never a wrong byte."""
    driver = open_driver(host_chunks=2, disk_chunks=8)
    tokens = tokens_of(4 * CHUNK)
    driver.store(tokens[: 2 * CHUNK])
    driver.persist()
    driver.store(tokens)
    driver.persist()
    driver.restart()
    assert_loads(driver, tokens, (2 if driver.name == "connector" else 4) * CHUNK)
