"""A slot's token record (``kvtier.io.token_record``): kept after the part table of its
header, read back only whole and checked, never past the header, whatever the bytes."""

import random
import struct
from array import array

import pytest

from kvtier.io.format import HEADER_BYTES, MAX_PARTS, Codec, SlotHeader, decode_header
from kvtier.io.token_record import (
    MAX_PARENT,
    encode_record,
    read_record,
    record_offset,
    record_room,
)

KEY, NS = b"k" * 16, b"n" * 16
TOKENS = array("i", range(-5, 251))  # 256 tokens, some negative


def header(record: bytes = b"", parts: tuple = ()) -> bytes:
    if parts:
        made = SlotHeader.in_parts(NS, KEY, parts, generation=7, created_ns=1)
    else:
        made = SlotHeader(NS, KEY, Codec.NONE, 4096, 4096, 1, 7, 1)
    data = made.encode(record=record)
    assert data is not None and len(data) == HEADER_BYTES
    return data


@pytest.mark.parametrize("parent", [b"", b"\x01" * 32, b"\xff" * MAX_PARENT])
def test_a_record_comes_back_whole_and_the_header_still_decodes(parent):
    data = header(encode_record(parent, TOKENS))
    decoded = decode_header(data)
    assert decoded.key == KEY
    record = read_record(data, decoded.num_parts)
    assert record is not None and record.parent == parent and record.tokens == TOKENS


def test_a_record_follows_a_part_table_and_leaves_it_whole():
    parts = ((1000, 11), (3096, 22), (100, 33))
    data = header(encode_record(b"p" * 32, TOKENS), parts)
    decoded = decode_header(data)
    assert decoded.parts == parts
    record = read_record(data, 3)
    assert record is not None and record.tokens == TOKENS
    assert read_record(data, 0) is None  # looked for in the wrong place: nothing


def test_a_header_without_a_record_and_one_too_long_for_it_hold_none():
    assert read_record(header(), 0) is None  # an older writer's, or a standalone store's
    too_long = encode_record(b"", array("i", range(record_room(0) + 64)))
    data = header(too_long)
    assert decode_header(data).key == KEY and read_record(data, 0) is None
    assert record_room(0) >= 768 and record_room(MAX_PARTS) == 0


def test_a_record_is_refused_for_a_long_parent_or_tokens_that_are_not_int32():
    with pytest.raises(ValueError, match="at most"):
        encode_record(b"x" * (MAX_PARENT + 1), TOKENS)
    with pytest.raises(ValueError, match="int32"):
        encode_record(b"", array("q", [1, 2]))


def test_every_flipped_byte_and_every_cut_is_no_record():
    record = encode_record(b"h" * 32, TOKENS[:64])
    at = record_offset(0)
    good = header(record)
    for i in range(len(record)):
        bad = bytearray(good)
        bad[at + i] ^= 0x5A
        assert read_record(bytes(bad), 0) is None, i
    for cut in (at, at + 10, at + len(record) - 1):
        assert read_record(good[:cut], 0) is None


def test_lengths_that_point_past_the_header_are_no_record():
    at = record_offset(0)
    for parent_len, count in [(MAX_PARENT + 1, 1), (0, 2**32 - 1), (0, 1000), (64, 990)]:
        data = bytearray(header())
        data[at:at + 16] = struct.pack("<8sHHI", b"KVTTOKS\x00", 1, parent_len, count)
        assert read_record(bytes(data), 0) is None


def test_random_bytes_after_the_magic_are_no_record():
    rng = random.Random(4)
    at = record_offset(0)
    for _ in range(500):
        data = bytearray(header())
        data[at:at + 8] = b"KVTTOKS\x00"
        tail = bytes(rng.getrandbits(8) for _ in range(rng.randrange(8, 200)))
        data[at + 8:at + 8 + len(tail)] = tail
        record = read_record(bytes(data), 0)
        assert record is None or len(record.tokens) * 4 + 24 <= HEADER_BYTES
