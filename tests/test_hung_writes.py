"""A standalone store on a drive whose writes stop answering: a write job out past
``load_timeout`` counts against its path at each call of the store, once per
``load_timeout``, and three take the path out of service (as three reads given up on do);
the writes waiting behind the hung job then fail at once and give back their host slots,
which a dead drive would otherwise pin for ever. The write still running keeps its slot
until it ends."""

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import SMALL, index_of, make_kv
from tests.helpers.store import config, seq

CHUNKS = 4  # the path's queue holds four (max_pending): none is dropped


def test_writes_stalled_past_load_timeout_take_the_path_out_and_free_the_waiting(tmp_path):
    make, engines = FakeEngine.factory()
    cfg = config(tmp_path, host_chunks=8, io_threads=1, load_timeout="100ms", disk_retry="off")
    with KVStore(SMALL, cfg, io_engine=make) as store:
        engines[0].hold("disk0")  # the drive stops answering writes
        try:
            for i in range(CHUNKS):  # one write runs (and hangs), the others wait behind it
                store.put(seq(1000 * i, 1), make_kv(seq(1000 * i, 1)))
            host = index_of(store, TierName.HOST)
            assert host.census().pins == CHUNKS and not store.stats().paths_down
            # every call of the store looks; nothing else goes to the disk meanwhile
            wait_until(lambda: store.lookup(seq(0, 1)).tokens >= 0 and store.stats().paths_down,
                       "a drive whose writes hang was never taken out of service")
            assert str(tmp_path) in store.stats().paths_down
            assert store.stats().load_timeouts == 0  # none given up: the write still runs
            assert host.census().pins == 1  # the waiting writes failed; the running one holds
            assert store.stats().disk_writes == 0
            later = [seq(50_000 + 1000 * i, 1) for i in range(8)]
            for tokens in later:  # host memory is all usable but the one slot
                store.put(tokens, make_kv(tokens))
            assert len(host) == 8
        finally:
            engines[0].release("disk0")
        wait_until(lambda: host.census().pins == 0, "the hung write's slot was never let go")


def test_a_write_job_queued_behind_hung_ones_gives_its_slots_back_once_the_path_is_out(tmp_path):
    """Two threads a path, both held by the dead drive (a read given up on, a write): the
    next write job waits in the engine's queue. Once the path is out it is cancelled, and
    its chunk's host slot given back, as the writes waiting for a job are."""
    import torch

    make, engines = FakeEngine.factory()
    cfg = config(tmp_path, host_chunks=8, io_threads=2, load_timeout="100ms", disk_retry="off")
    with KVStore(SMALL, cfg, io_engine=make) as store:
        early = seq(0, 10)
        store.put(early, make_kv(early))
        assert store.flush(10).not_written == 0  # its first chunk now only on disk
        host = index_of(store, TierName.HOST)
        engines[0].hold("disk0")
        try:
            first = seq(0, 1)
            store.get(first, torch.zeros(SMALL.shape(len(first)), dtype=getattr(torch, SMALL.dtype)))
            before = host.census().pins  # the hung read's
            for i in range(1, 5):  # a write job hangs, the next queues in the engine, 2 wait
                store.put(seq(1000 * i, 1), make_kv(seq(1000 * i, 1)))
            assert host.census().pins - before == 4
            wait_until(lambda: store.lookup(first).tokens >= 0 and store.stats().paths_down,
                       "a drive that stopped answering was never taken out of service")
            assert host.census().pins - before == 1  # the running write's, until it ends
        finally:
            engines[0].release("disk0")


class Interrupting:
    """A write's future whose first wait for its result is interrupted (Ctrl-C in the
    thread waiting on it); everything else is the future's own."""

    def __init__(self, future) -> None:
        self._future = future

    def result(self, timeout=None):
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self._future, name)


def test_a_put_interrupted_while_a_victim_is_written_back_leaves_its_slot_to_the_write(tmp_path):
    """Write-back, host memory full: a put waits for its victim's write to disk and is
    interrupted there. The victim's host slot stays reserved until its write ends (before,
    it went back at once, the next put's chunk landed in it, and the write stored that
    chunk's bytes under the victim's key, found after a reopen), and the write's disk slot
    is finished then too."""
    from kvtier.tiers.base import TierName
    from tests.helpers.kv import same_bytes
    from tests.helpers.store import load

    make, engines = FakeEngine.factory()
    cfg = config(tmp_path, host_chunks=2, disk_chunks=16, write_policy="write_back",
                 load_timeout="1s")
    first, second, victim_of_c = seq(0, 1), seq(1000, 1), seq(2000, 1)
    store = KVStore(SMALL, cfg, io_engine=make)
    store.put(first, make_kv(first))
    store.put(seq(3000, 1), make_kv(seq(3000, 1)))  # host full: ``first`` the oldest
    lane, submit = store._state.lane, store._state.lane.submit
    engines[0].hold()  # the write-back of ``first`` waits
    lane.submit = lambda queue, job: Interrupting(submit(queue, job))
    try:
        store.put(second, make_kv(second))
        raise AssertionError("the put was not interrupted")
    except KeyboardInterrupt:
        pass
    lane.submit = submit
    store.put(victim_of_c, make_kv(victim_of_c))  # no slot of the write's: waits, then skips
    engines[0].release()
    assert engines[0].drain(5)
    for tier in (TierName.HOST, TierName.DISK):
        census = index_of(store, tier).census()
        assert census.writing == 0 and census.pins == 0, (tier, census)
    assert store.close()
    with KVStore(SMALL, cfg) as reopened:
        n, got = load(reopened, first)
        assert n == 0 or same_bytes(got, make_kv(first)[:, :, :n])
