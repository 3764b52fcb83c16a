"""A writer of the shared directory whose log names chunks its slots do not hold (a broken
engine, a disk that lost its writes, a hostile co-writer naming keys it can compute) and
names them again after their reads proved them bad: once its copies mostly do, it is passed
over for a while (``kvtier.shared.trust``), so a reader writes its own copies rather than
missing on every request while that writer names them. An honest writer, whose copies prove
bad only in races with its own overwrites, never is."""

import shutil

from kvtier import KVStore
from kvtier.io.buffers import AlignedBuffer
from kvtier.ops.cache import namespaces, slot_file_sizes
from kvtier.ops.segments import rewrite_log
from kvtier.shared import trust as trust_module
from kvtier.shared.trust import BAD_COPIES, DISTRUST_S, WINDOW_S, WriterTrust
from tests.helpers.faults import flip
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv
from tests.helpers.shared import shared, wait_for
from tests.helpers.store import STRIDE, exact, load, seq

LIAR, OTHER = (0, "liar"), (0, "other")


def copy(writer, n):
    return (*writer, n, bytes([n]) * 16)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_writer_whose_copies_prove_bad_again_once_named_again_is_passed_over():
    clock = Clock()
    trust = WriterTrust(clock)
    assert not any(trust.bad(copy(LIAR, n)) for n in range(BAD_COPIES))  # maybe races
    assert trust.trusted(LIAR)
    again = [trust.bad(copy(LIAR, n)) for n in range(BAD_COPIES)]  # named again, bad again
    assert again == [False] * (BAD_COPIES - 1) + [True]
    assert not trust.trusted(LIAR) and trust.any_distrusted and trust.distrusted == 1
    assert trust.trusted(OTHER)
    assert not trust.bad(copy(LIAR, 0))  # a read under way then counts for nothing
    clock.now += DISTRUST_S
    assert trust.trusted(LIAR) and not trust.any_distrusted
    assert not any(trust.bad(copy(LIAR, n)) for n in range(BAD_COPIES - 1))  # counted afresh
    assert trust.trusted(LIAR)


def test_an_honest_writers_races_never_count():
    """A writer evicting a whole prompt under a reader's view fails its whole load; should it
    write those chunks into those slots again, they then read well."""
    trust = WriterTrust(Clock())
    for _ in range(3):
        assert not any(trust.bad(copy(OTHER, n)) for n in range(100))
        for n in range(100):
            trust.good(copy(OTHER, n))
    assert trust.trusted(OTHER) and trust.distrusted == 0


def test_a_few_bad_copies_among_many_good_leave_a_writer_trusted():
    trust = WriterTrust(Clock())
    for n in range(BAD_COPIES):
        trust.bad(copy(OTHER, n))
    for n in range(BAD_COPIES + 1):
        trust.good(copy(OTHER, 100 + n))
    assert not any(trust.bad(copy(OTHER, n)) for n in range(BAD_COPIES))
    assert trust.trusted(OTHER)


def test_bad_copies_far_apart_never_add_up():
    clock = Clock()
    trust = WriterTrust(clock)
    for n in range(3 * BAD_COPIES):
        trust.bad(copy(LIAR, n))
    for first in range(0, 3 * BAD_COPIES, BAD_COPIES - 1):
        for n in range(first, first + BAD_COPIES - 1):
            trust.bad(copy(LIAR, n))
        clock.now += WINDOW_S
    assert trust.trusted(LIAR)


def test_a_writer_no_longer_followed_is_forgotten():
    """Its writer id may be taken again by another engine: that one starts trusted."""
    trust = WriterTrust(Clock())
    for n in list(range(BAD_COPIES)) * 2:
        trust.bad(copy(LIAR, n))
    assert not trust.trusted(LIAR)
    trust.forget(LIAR)
    assert trust.trusted(LIAR)
    assert not any(trust.bad(copy(LIAR, n)) for n in range(BAD_COPIES))  # first times again


def test_a_writer_passed_over_is_never_forgotten_among_many(monkeypatch):
    monkeypatch.setattr(trust_module, "MAX_WRITERS", 4)
    trust = WriterTrust(Clock())
    for n in list(range(BAD_COPIES)) * 2:
        trust.bad(copy(LIAR, n))
    for w in range(20):
        trust.good(copy((0, f"w{w}"), 0))
    assert not trust.trusted(LIAR) and len(trust._reads) <= 5


def corrupt_every_payload(root, writer: str) -> None:
    (slots,) = root.glob(f"*/writers/{writer}/slots-0000.kvt")
    for slot in range(slots.stat().st_size // STRIDE):
        flip(slots, slot * STRIDE + 4096 + 100)


def name_them_again(root, writer: str) -> None:
    """``writer``'s log started afresh from its index, as a writer does at each start: its
    readers follow it from the start again, every chunk it names named again."""
    (segment,) = [s for ns in namespaces(root) for s in ns.segments if s.writer == writer]
    with segment.open() as handle:
        assert rewrite_log(segment, handle, slot_file_sizes(segment.meta, handle)) == ""


def round_of(reader, root, prompt) -> int:
    """The liar names its chunks again; the reader computes ``prompt`` (written to its disk
    as it leaves host memory, unless another writer holds it), then loads it."""
    name_them_again(root, "liar")
    wait_for(lambda: reader.stats().shared_chunks == 12)
    reader.put(prompt, make_kv(prompt))
    assert reader.flush()
    return load(reader, prompt)[0] and exact(reader, prompt)


def test_a_writer_whose_copies_prove_bad_no_longer_keeps_a_reader_from_writing_them(tmp_path):
    prompt = seq(0, 12)
    with KVStore(SMALL, shared(tmp_path, "liar", disk_chunks=128)) as liar:
        liar.put(prompt, make_kv(prompt))
        assert liar.flush()
    corrupt_every_payload(tmp_path, "liar")
    served = []
    with KVStore(SMALL, shared(tmp_path, "reader", disk_chunks=128, write_policy="write_back")) as reader:
        while not reader.stats().shared_writers_distrusted:  # a miss each round meanwhile
            assert len(served) < 2 * BAD_COPIES, f"the liar was never passed over: {served}"
            served.append(round_of(reader, tmp_path, prompt))
        served += [round_of(reader, tmp_path, prompt) for _ in range(2)]
        stats = reader.stats()
    assert set(served[:-2]) == {0} and len(served) >= 4, served  # (2 copies read a load)
    assert served[-2:] == [12 * CHUNK] * 2, served  # its own copies
    assert stats.shared_writers_distrusted == 1


def read_all(reader, prompt) -> list:
    """Read every copy another writer holds of ``prompt``'s chunks at once, each outcome
    told, as an engine's load does (``LoadPlanner``)."""
    others = reader._state.others
    refs = [others.find(key) for key in reader.keys(prompt)]
    assert all(refs), "the reader's view names every chunk"
    results = others.read_many([(ref, AlignedBuffer(CHUNK_BYTES).array) for ref in refs])
    for ref, result in zip(refs, results, strict=True):
        others.read_over(ref, result)
    return [result.ok for result in results]


def test_an_honest_writer_that_evicts_a_prompt_under_a_readers_view_stays_trusted(tmp_path):
    """Its disk full, the writer writes over a prompt's slots between two refreshes of a
    reader's view, so that a load of all of it fails at once; it writes the prompt again
    later (into those slots), and the reader's next load of it reads it there."""
    prompt, other = seq(0, 12), seq(100_000, 32)
    with KVStore(SMALL, shared(tmp_path, "busy", disk_chunks=128)) as busy, \
            KVStore(SMALL, shared(tmp_path, "reader", share_refresh="1h")) as reader:
        busy.put(prompt, make_kv(prompt))
        for _ in range(3):
            assert busy.flush()
            reader._state.others.refresh()
            busy.put(other, make_kv(other))  # its 32 slots: the prompt's written over
            assert busy.flush()
            assert read_all(reader, prompt) == [False] * 12
            busy.put(prompt, make_kv(prompt))  # over the oldest of the others: its old slots
            assert busy.flush()
            reader._state.others.refresh()
            assert read_all(reader, prompt) == [True] * 12
        assert reader.stats().shared_writers_distrusted == 0
        assert exact(reader, prompt) == 12 * CHUNK


def test_a_writer_id_taken_again_after_its_segment_went_starts_trusted(tmp_path):
    prompt = seq(0, 4)
    with KVStore(SMALL, shared(tmp_path, "host-0")) as first:
        first.put(prompt, make_kv(prompt))
        assert first.flush()
    with KVStore(SMALL, shared(tmp_path, "reader")) as reader:
        wait_for(lambda: reader.stats().shared_chunks == 4)
        trust = reader._state.others.trust
        for n in list(range(BAD_COPIES)) * 2:
            trust.bad(copy((0, "host-0"), n))
        assert not trust.trusted((0, "host-0"))
        (segment,) = tmp_path.glob("*/writers/host-0")
        shutil.rmtree(segment)  # reclaimed: no longer followed
        wait_for(lambda: trust.trusted((0, "host-0")))
        with KVStore(SMALL, shared(tmp_path, "host-0")) as again:  # another engine, that id
            again.put(prompt, make_kv(prompt))
            assert again.flush()
            wait_for(lambda: reader.lookup(prompt).tokens == 4 * CHUNK)
            assert exact(reader, prompt) == 4 * CHUNK


def test_a_new_writer_among_as_many_passed_over_as_are_counted_is_counted(monkeypatch):
    """Every writer counted but the new one passed over: none to let go but it, kept."""
    monkeypatch.setattr(trust_module, "MAX_WRITERS", 2)
    trust = WriterTrust(Clock())
    for liar in (LIAR, (0, "liar-2")):
        for n in list(range(BAD_COPIES)) * 2:
            trust.bad(copy(liar, n))
    trust.good(copy(OTHER, 0))
    assert not trust.trusted(LIAR) and not trust.trusted((0, "liar-2")) and trust.trusted(OTHER)
