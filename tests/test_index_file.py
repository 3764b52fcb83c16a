"""Reading a segment's index file a piece at a time (``written_index_entries``)."""

import pytest

import kvtier.io.index_file as index_file
from kvtier.io.format import INDEX_ENTRY_BYTES, MAGIC
from kvtier.io.index_file import written_index_entries
from kvtier.io.names import INDEX_FILE
from kvtier.io.safefs import SafeDir


def entry(slot: int) -> bytes:
    """An entry that is not blank (kvtier's magic first), telling its slot apart."""
    return (MAGIC + slot.to_bytes(8, "little")).ljust(INDEX_ENTRY_BYTES, b"\x01")


def write_index(path, slots: int, written: set[int], tail: bytes = b"") -> None:
    data = bytearray(slots * INDEX_ENTRY_BYTES)
    for slot in written:
        data[slot * INDEX_ENTRY_BYTES:(slot + 1) * INDEX_ENTRY_BYTES] = entry(slot)
    (path / INDEX_FILE).write_bytes(bytes(data) + tail)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr("kvtier.io.index_file.INDEX_PIECE_ENTRIES", 4)


def entries(path, slots: int) -> list[tuple[int, bytes]]:
    with SafeDir.open(path) as directory:
        return list(written_index_entries(directory, slots))


def test_every_written_entry_over_many_pieces_and_no_blank_one(tmp_path):
    written = {0, 3, 4, 9, 10, 11, 17}  # pieces of 4: some full, some empty, one partial
    write_index(tmp_path, 18, written)
    assert entries(tmp_path, 100) == [(slot, entry(slot)) for slot in sorted(written)]


def test_no_entry_past_the_slots_asked_for(tmp_path):
    write_index(tmp_path, 18, {1, 6, 7, 8, 12})
    assert [slot for slot, _ in entries(tmp_path, 8)] == [1, 6, 7]


def test_a_partial_last_entry_and_a_missing_file_hold_nothing(tmp_path):
    assert entries(tmp_path, 100) == []
    write_index(tmp_path, 5, {2, 4}, tail=MAGIC + b"half an entry")
    assert [slot for slot, _ in entries(tmp_path, 100)] == [2, 4]


def test_a_huge_sparse_index_is_read_a_piece_at_a_time(tmp_path, monkeypatch):
    write_index(tmp_path, 4, {1})
    with open(tmp_path / INDEX_FILE, "r+b") as index:
        index.truncate(1 << 30)
    reads: list[int] = []
    real = index_file.read_at

    def counted(fd, length, offset):
        reads.append(length)
        return real(fd, length, offset)

    monkeypatch.setattr(index_file, "INDEX_PIECE_ENTRIES", 8192)
    monkeypatch.setattr(index_file, "read_at", counted)
    assert [slot for slot, _ in entries(tmp_path, 1 << 16)] == [1]
    assert max(reads) == 8192 * INDEX_ENTRY_BYTES and sum(reads) == (1 << 16) * INDEX_ENTRY_BYTES
