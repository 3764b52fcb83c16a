"""A compressed slot never costs more memory than its chunk: a zstd frame that declares (or
decodes to) another size is CORRUPT before anything of that size is allocated."""

import tracemalloc

import numpy as np
import pytest
import zstandard

from kvtier import KVStore
from kvtier.io import codec as codecs
from kvtier.io.format import Codec
from tests.helpers.kv import CHUNK_BYTES, SMALL, make_kv
from tests.helpers.store import config, load, seq

MiB = 1 << 20


def frame_declaring(size: int, data: bytes = b"\0" * MiB, end: bool = True) -> bytes:
    """A real zstd frame whose header declares ``size`` bytes, holding ``data`` (the
    frame is cut short after it unless ``end``: a header is all a bomb needs)."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=size)
    body = compressor.compress(data)
    return body + compressor.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH if end
                                   else zstandard.COMPRESSOBJ_FLUSH_BLOCK)


def zeros_frame(size: int) -> bytes:
    """A whole frame of ``size`` zero bytes (a few KiB: zeros compress well)."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=size)
    return b"".join(compressor.compress(b"\0" * MiB) for _ in range(size // MiB)) + compressor.flush()


def test_a_frame_declaring_more_than_the_chunk_is_refused_before_it_is_decoded():
    frame = zeros_frame(64 * MiB)  # a real frame: it would decode, to 64 MiB
    out = np.zeros(CHUNK_BYTES, dtype=np.uint8)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=f"declares {64 * MiB} bytes, expected {CHUNK_BYTES}"):
            codecs.decode(Codec.ZSTD, frame, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB, f"{peak} bytes allocated to refuse a frame"


def test_a_frame_declaring_an_impossible_size_is_a_clean_value_error():
    out = np.zeros(CHUNK_BYTES, dtype=np.uint8)
    with pytest.raises(ValueError, match=f"declares {2**40} bytes"):  # never a MemoryError
        codecs.decode(Codec.ZSTD, frame_declaring(2**40, end=False), out)


def test_a_frame_declaring_nothing_stops_at_the_chunk_size():
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * 8 * MiB)
    assert zstandard.frame_content_size(unsized) == -1
    with pytest.raises(ValueError, match="does not decode"):
        codecs.decode(Codec.ZSTD, unsized, np.zeros(CHUNK_BYTES, dtype=np.uint8))


def test_a_bad_frame_header_is_a_value_error():
    with pytest.raises(ValueError, match="does not decode"):
        codecs.decode(Codec.ZSTD, b"not a zstd frame at all", np.zeros(CHUNK_BYTES, dtype=np.uint8))


def test_frames_written_by_the_store_still_decode():
    raw = (np.arange(32768, dtype=np.uint16) // 64).view(np.uint8)  # 64 KiB, compressible
    packed = codecs.encode(raw, 2)
    assert packed is not None
    codec, blob = packed
    assert zstandard.frame_content_size(blob) == raw.size
    out = np.zeros_like(raw)
    codecs.decode(codec, blob, out)
    assert np.array_equal(out, raw)


def test_a_bomb_in_a_disk_slot_is_a_corrupt_miss(tmp_path, monkeypatch):
    """A slot whose frame declares a terabyte (another writer's, or planted): the get
    misses, the slot counts as corrupt and is blanked, and nothing of that size is made."""
    tokens = seq(0, 1)
    bomb = frame_declaring(2**40, end=False)
    monkeypatch.setattr(codecs, "encode", lambda raw, element_bytes: (Codec.ZSTD, bomb))
    with KVStore(SMALL, config(tmp_path, compression="zstd")) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
    monkeypatch.undo()
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.lookup(tokens).tokens == len(tokens)
        assert load(store, tokens)[0] == 0
        stats = store.stats()
        assert (stats.corruptions, stats.io_errors) == (1, 0)
        assert store.lookup(tokens).tokens == 0
    with KVStore(SMALL, config(tmp_path)) as store:  # blanked: not adopted again
        assert store.stats().recovered_chunks == 0
