"""Reading a segment's index file a piece at a time (``written_index_entries``), and the
scheduler side's reading of every path's index with it (``read_disk_index``)."""

import pytest

import kvtier.segment.index_file as index_file
from kvtier.io.format import INDEX_ENTRY_BYTES, MAGIC
from kvtier.io.safefs import SafeDir
from kvtier.segment.index_file import written_index_entries
from kvtier.segment.names import INDEX_FILE


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
    monkeypatch.setattr("kvtier.segment.index_file.INDEX_PIECE_ENTRIES", 4)


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


def test_the_scheduler_side_reads_each_paths_index_and_maps_its_slots(tmp_path):
    """``read_disk_index`` over two paths: slot ``s`` lives on path ``s % 2`` at local entry
    ``s // 2``; every chunk the disk tier wrote is found at its own slot, with its header."""
    from kvtier.disk.tier import DiskTier
    from kvtier.io.buffers import AlignedBuffer
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.segment.index_file import SlotLayout, read_disk_index

    raw = 4096
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="t", block_tokens=16, chunk_tokens=16)
    for name in ("a", "b"):
        (tmp_path / name).mkdir(mode=0o700)
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    capacity = 8 * (4096 + raw)  # 8 slots, 4 a path
    disk = DiskTier(roots, ns, raw, capacity)
    keys = {slot: ChunkKey(bytes([slot + 1]) * 16) for slot in (0, 1, 2, 5)}
    buffer = AlignedBuffer(raw)
    assert all(disk.write(slot, key, buffer.array).ok for slot, key in keys.items())
    writer = disk.writer
    disk.close()
    found = read_disk_index(roots, ns, SlotLayout(raw, 2, capacity), writer)
    assert {key: slot for key, (slot, _) in found.items()} == {key: slot for slot, key in keys.items()}
    assert all(header.key == key for key, (_, header) in found.items())


def test_the_scheduler_side_asks_every_path_at_once_before_it_reads_any(tmp_path, monkeypatch):
    """Several hung mounts cost the start one wait, not one each: every path is asked
    before any is waited on (``answers.ask``)."""
    from kvtier.keys import Namespace
    from kvtier.segment.index_file import SlotLayout, read_disk_index

    calls = []
    monkeypatch.setattr(index_file, "ask", lambda roots, timeout: calls.append(("ask", list(roots))))
    monkeypatch.setattr(index_file, "answers",
                        lambda root, timeout: calls.append(("wait", root)) or False)
    roots = [str(tmp_path / name) for name in ("a", "b", "c")]
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="t", block_tokens=16, chunk_tokens=16)
    assert read_disk_index(roots, ns, SlotLayout(4096, 3, 6 * 8192), "w", answer_timeout=5.0) == {}
    assert calls == [("ask", roots)] + [("wait", root) for root in roots]
