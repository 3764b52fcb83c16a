"""A writer of the shared directory whose log names chunks its slots do not hold (a broken
engine, a disk that lost its writes, a hostile co-writer naming keys it can compute): its
copies keep proving bad when read, and once they mostly do it is passed over for a while
(``kvtier.shared.trust``), so a reader writes its own copies rather than missing on every
request while that writer names them again."""

from kvtier import KVStore
from kvtier.ops.cache import namespaces, slot_file_sizes
from kvtier.ops.segments import rewrite_log
from kvtier.shared.trust import BAD_COPIES, DISTRUST_S, WINDOW_S, WriterTrust
from tests.helpers.faults import flip
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.shared import shared, wait_for
from tests.helpers.store import STRIDE, exact, load, seq


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_writer_whose_reads_prove_bad_is_passed_over_for_a_while():
    clock = Clock()
    trust = WriterTrust(clock)
    made = [trust.read("liar", True) for _ in range(BAD_COPIES)]
    assert made == [False] * (BAD_COPIES - 1) + [True]
    assert not trust.trusted("liar") and trust.any_distrusted and trust.distrusted == 1
    assert trust.trusted("other")
    assert not trust.read("liar", True)  # a read under way then counts for nothing
    clock.now += DISTRUST_S
    assert trust.trusted("liar") and not trust.any_distrusted
    assert not any(trust.read("liar", True) for _ in range(BAD_COPIES - 1))  # counted afresh
    assert trust.trusted("liar")


def test_a_writer_with_a_few_bad_copies_among_many_good_stays_trusted():
    """A writer reusing slots faster than a reader follows its log: some copies overwritten."""
    trust = WriterTrust(Clock())
    for _ in range(3):
        for _ in range(BAD_COPIES):
            trust.read("busy", False)
            trust.read("busy", True)
    trust.read("busy", False)
    assert trust.trusted("busy") and trust.distrusted == 0


def test_bad_reads_far_apart_never_add_up():
    clock = Clock()
    trust = WriterTrust(clock)
    for _ in range(3):
        for _ in range(BAD_COPIES - 1):
            trust.read("slow", True)
        clock.now += WINDOW_S
    assert trust.trusted("slow")


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


def test_a_writer_whose_copies_prove_bad_no_longer_keeps_a_reader_from_writing_them(tmp_path):
    prompt = seq(0, 12)
    with KVStore(SMALL, shared(tmp_path, "liar", disk_chunks=128)) as liar:
        liar.put(prompt, make_kv(prompt))
        assert liar.flush()
    corrupt_every_payload(tmp_path, "liar")
    served = []
    # write-back: a chunk leaving host memory is written to disk unless another writer holds it
    with KVStore(SMALL, shared(tmp_path, "reader", disk_chunks=128, write_policy="write_back")) as reader:
        for _ in range(4):  # the liar names its chunks again and again
            name_them_again(tmp_path, "liar")
            wait_for(lambda: reader.stats().shared_chunks == 12)
            reader.put(prompt, make_kv(prompt))  # computed: not written while the liar names it
            assert reader.flush()
            served.append(load(reader, prompt)[0] and exact(reader, prompt))
        stats = reader.stats()
    # a miss while the liar's copies were read (a few a load), then its own copies
    assert served[0] == 0 and served[-2:] == [12 * CHUNK] * 2, served
    assert stats.shared_failures >= BAD_COPIES and stats.shared_writers_distrusted == 1
