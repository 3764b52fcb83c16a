"""Malformed slot headers and index files: a clean rejection, never an escaping exception."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.io.format import HEADER_BYTES, MAGIC, Codec, HeaderError, SlotHeader, decode_header
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import SlotLayout, parse_index, valid_header

NS = bytes(range(16))
LAYOUT = SlotLayout(raw_bytes=8192, num_paths=1, capacity=64 * (4096 + 8192))
GOOD = SlotHeader(NS, ChunkKey(b"k" * 16), Codec.NONE, 8192, 8192, 1234, 7, 99).encode()


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=HEADER_BYTES),
                 st.binary(max_size=200).map(lambda tail: MAGIC + tail)))
def test_random_bytes_are_rejected_cleanly(data):
    with pytest.raises(HeaderError):
        decode_header(data)
    assert valid_header(data, NS, LAYOUT) is None


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 127), st.integers(1, 255))
def test_any_flipped_bit_of_a_header_is_caught(offset, mask):
    broken = bytearray(GOOD)
    broken[offset] ^= mask
    try:
        header = decode_header(bytes(broken))
    except HeaderError:
        return
    assert header == decode_header(GOOD)  # only bytes outside the checked prefix may differ


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(GOOD[:128]), st.binary(min_size=128, max_size=128),
                          st.just(bytes(128))), max_size=40), st.binary(max_size=127))
def test_index_files_of_any_content_parse_cleanly(entries, tail):
    found, bad = parse_index(b"".join(entries) + tail, NS, LAYOUT, 0)
    assert all(0 <= slot < LAYOUT.per_path for slot, _ in found)
    good = sum(entry == GOOD[:128] for entry in entries[: LAYOUT.per_path])
    assert len(found) == good and bad <= len(entries)
