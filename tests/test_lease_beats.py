"""One path's lease heartbeat never waits on another's: a path whose filesystem hangs holds
back only its own beats, and goes out of service once its beat has hung for three turns
(its lease stands still meanwhile, as it would for a writer that is gone). Each lease is
beaten by one long-lived thread, never by a thread started per beat."""

import threading

from kvtier.io.safefs import SafeDir
from kvtier.segment import lease_keeper
from kvtier.segment.lease import read_lease
from kvtier.segment.lease_keeper import HUNG_TURNS, LeaseHung, LeaseKeeper
from tests.helpers.disk_helpers import NS, make_tier
from tests.helpers.shared import wait_for

WAIT_S = 20.0  # a bound on waits for what must come soon, never a measure of speed


class Beats:
    """A stand-in lease counting its beats and keeping the thread of each (so that no two
    are ever the same object by chance); each beat waits for ``hang`` when given."""

    def __init__(self, path: str, hang: threading.Event | None = None) -> None:
        self.path, self.hang, self.count = path, hang, 0
        self.threads: list[threading.Thread] = []
        self.returned = 0
        self._changed = threading.Condition()

    def beat(self) -> None:
        with self._changed:
            self.count += 1
            self.threads.append(threading.current_thread())
            self._changed.notify_all()
        if self.hang is not None:
            self.hang.wait()
        self.returned += 1

    def beaters(self) -> set[int]:
        """The threads that beat it, by object identity."""
        with self._changed:
            return {id(thread) for thread in self.threads}

    def reached(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= count, WAIT_S)


def test_a_beat_that_hangs_holds_back_no_other_lease(tmp_path):
    hang = threading.Event()
    hung, good = Beats("/hung", hang), Beats("/good")
    lost: list[tuple[object, Exception]] = []
    said = threading.Event()

    def on_lost(lease, error):
        lost.append((lease, error))
        said.set()

    keeper = LeaseKeeper(lambda: [hung, good], every=0.01, on_conflict=on_lost)
    try:
        assert hung.reached(1)
        assert good.reached(HUNG_TURNS + 5)  # beats on while the first path hangs
        assert said.wait(WAIT_S)
        assert hung.count == 1  # never beaten again while its beat hangs: one thread waits
        ((lease, error),) = lost
        assert lease is hung and isinstance(error, LeaseHung)
        assert "heartbeat" in str(error) and "hung" in str(error)
    finally:
        hang.set()
    assert hung.reached(2)  # once its beat returned, it beats again
    keeper.close()


def test_a_path_whose_lease_beat_hangs_goes_out_and_the_other_paths_beat_on(tmp_path):
    roots = [tmp_path / "p0", tmp_path / "p1"]
    for root in roots:
        root.mkdir(mode=0o700)
    tier = make_tier(roots, writers=["node-a"], lease_timeout=0.6)  # a beat every 0.1 s
    hang = threading.Event()
    stuck = tier.paths[0].dir
    assert stuck is not None and stuck.lease is not None
    stuck.lease.beat = lambda: hang.wait()  # an NFS server gone: this path's beat never returns
    segment = SafeDir.open(roots[1] / NS.id / "writers" / "node-a")
    try:
        first = read_lease(segment).beat
        wait_for(lambda: read_lease(segment).beat >= first + HUNG_TURNS + 3, WAIT_S)
        wait_for(lambda: 0 in tier.paths.down, WAIT_S)
        down = tier.paths.down
        assert list(down) == [0] and "heartbeat" in down[0]
        assert tier.paths[1].dir is not None
    finally:
        hang.set()
        segment.close()
        tier.close()


def test_each_lease_is_beaten_by_one_thread_of_its_own_over_many_beats():
    first, second = Beats("/p0"), Beats("/p1")
    keeper = LeaseKeeper(lambda: [first, second], every=0.01)
    try:
        assert first.reached(30) and second.reached(30)
        assert len(first.beaters()) == 1 and len(second.beaters()) == 1  # no thread per beat
        assert first.beaters() != second.beaters()  # one path never waits on another's
    finally:
        keeper.close()
    for thread in first.threads[:1] + second.threads[:1]:
        thread.join(WAIT_S)
        assert not thread.is_alive()  # closed: no thread left behind


def test_a_lease_no_longer_listed_has_its_thread_end_and_one_listed_anew_is_beaten():
    old, new = Beats("/p0"), Beats("/p0")  # a path out of service, then back (a new lease)
    listed = [old]
    keeper = LeaseKeeper(lambda: list(listed), every=0.01)
    try:
        assert old.reached(3)
        listed[:] = [new]
        assert new.reached(3)
        thread = old.threads[0]
        thread.join(WAIT_S)
        assert not thread.is_alive()
        assert not new.beaters() & old.beaters()
        listed[:] = [new, old]  # listed again: beaten again
        assert old.reached(old.count + 2)
    finally:
        keeper.close()


def test_close_waits_for_a_beat_under_way(monkeypatch):
    monkeypatch.setattr(lease_keeper, "CLOSE_WAIT_S", 10 * WAIT_S)
    gate = threading.Event()
    slow = Beats("/slow", gate)
    keeper = LeaseKeeper(lambda: [slow], every=0.01)
    closed = threading.Event()
    try:
        assert slow.reached(1)
        threading.Thread(target=lambda: (keeper.close(), closed.set()), daemon=True).start()
        assert not closed.wait(0.2)  # its beat under way holds close back
    finally:
        gate.set()
    assert closed.wait(WAIT_S)
    assert slow.returned == slow.count  # the beat returned before close did


def test_close_never_waits_for_ever_on_a_hung_beat(monkeypatch):
    monkeypatch.setattr(lease_keeper, "CLOSE_WAIT_S", 0.05)
    hang = threading.Event()
    hung, good = Beats("/hung", hang), Beats("/good")
    keeper = LeaseKeeper(lambda: [hung, good], every=0.01)
    closed = threading.Event()
    try:
        assert hung.reached(1) and good.reached(3)
        threading.Thread(target=lambda: (keeper.close(), closed.set()), daemon=True).start()
        assert closed.wait(WAIT_S)
        assert hung.count == 1 and hung.returned == 0  # still hung when close returned
    finally:
        hang.set()
    thread = hung.threads[0]
    thread.join(WAIT_S)
    assert not thread.is_alive()  # once its beat returned, its thread ended
    assert hung.count == 1  # and never beat after close


def test_a_path_whose_lease_beats_fail_goes_out_before_the_others_take_its_writer_for_gone(
        tmp_path):
    """A beat that fails (the filesystem full, the lease file swapped for a directory)
    leaves the lease standing still while the writer writes on: the other engines would
    reclaim a live segment (a review deleted a live writer's slot file so). Once beats
    failed ``HUNG_TURNS`` times in a row the path goes out, as for a hung beat; a beat
    that works again in between starts the count over."""
    import errno

    roots = [tmp_path / "p0", tmp_path / "p1"]
    for root in roots:
        root.mkdir(mode=0o700)
    tier = make_tier(roots, writers=["node-a"], lease_timeout=0.6)  # a beat every 0.1 s
    failing = tier.paths[0].dir
    assert failing is not None and failing.lease is not None
    outcomes = iter([OSError(errno.ENOSPC, "No space left on device")] * (HUNG_TURNS - 1)
                    + [None] + [OSError(errno.ENOSPC, "No space left on device")] * 99)
    beats: list[object] = []

    def beat():
        outcome = next(outcomes)
        beats.append(outcome)
        if outcome is not None:
            raise outcome
    failing.lease.beat = beat
    try:
        wait_for(lambda: 0 in tier.paths.down, WAIT_S)
        assert len(beats) >= 2 * HUNG_TURNS  # not at the first run of failures: one worked
        down = tier.paths.down
        assert list(down) == [0] and "heartbeat" in down[0] and "in a row" in down[0]
        assert tier.paths[1].dir is not None
    finally:
        tier.close()
