"""The store's one lock is owned by ``Books`` (kvtier/store/books.py): no other module of
kvtier/store/ names or takes it, and each of the owner's methods does what it says."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.shared.follower import FollowedCounts
from kvtier.store.books import Books, open_books
from kvtier.store.skip import Skip
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import LRUPolicy
from kvtier.tiers.prefix import Ours
from kvtier.tiers.stack import Location, StorePlan, TierStack

STORE = Path(__file__).resolve().parents[1] / "kvtier" / "store"
OWNER = "books.py"
OWN_LOCKS = {"gate.py"}  # CallGate's lock is its own (the calls in flight), not the store's
HOST, DISK = TierName.HOST, TierName.DISK


def lock_uses(path: Path) -> list[str]:
    """Where ``path`` names or takes a lock: an attribute ``lock``/``_lock``, a ``with`` on a
    name ending in ``lock``, a lock made, or ``acquire`` called."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        line = getattr(node, "lineno", None) or getattr(getattr(node, "context_expr", None), "lineno", 0)
        where = f"{path.name}:{line}"
        if isinstance(node, ast.Attribute) and node.attr in {"lock", "_lock"}:
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Call) and _name(node.func) in {"Lock", "RLock", "Condition",
                                                                 "acquire"}:
            found.append(f"{where} {_name(node.func)}()")
        elif isinstance(node, ast.withitem) and _name(node.context_expr).lower().endswith("lock"):
            found.append(f"{where} with {_name(node.context_expr)}")
    return found


def _name(expr: ast.expr) -> str:
    return expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", "")


def test_only_the_owner_takes_the_store_lock():
    others = sorted(p for p in STORE.glob("*.py") if p.name not in {OWNER, *OWN_LOCKS})
    assert len(others) > 10
    uses = [use for path in others for use in lock_uses(path)]
    assert uses == [], f"the store's lock is Books' alone (kvtier/store/books.py): {uses}"


def test_the_check_sees_a_lock_taken():
    assert lock_uses(STORE / OWNER), "the owner's own uses are found"
    assert lock_uses(STORE / "gate.py"), "and CallGate's"


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def books_of(host: int = 2, disk: int = 4, lane=None) -> Books:
    return Books(TierStack([(HOST, SlotIndex(host, LRUPolicy())),
                            (DISK, SlotIndex(disk, LRUPolicy()))]), lane)


def test_a_put_is_planned_committed_and_then_present():
    books = books_of()
    plan = books.plan_put(key(1))
    assert plan is not Skip.PRESENT and plan is not Skip.NO_ROOM
    assert books.plan_put(key(1)) is Skip.PRESENT  # being written
    books.abort([(plan.key, plan.dst)])
    plan = books.plan_store(key(1), HOST)
    assert plan is not None
    with books.held() as b:
        b.stack.finish(plan.key, plan.dst, True)
    assert books.plan_put(key(1)) is Skip.PRESENT
    assert books.slot_of(HOST, key(1)) == plan.dst.slot
    assert books.cached([key(1), key(2)], None) == [Ours(plan.dst)]
    assert books.top is HOST and books.slots == {HOST: 2, DISK: 4}


def test_pins_hold_a_slot_against_eviction_until_given_back():
    books = books_of(host=1, disk=0)
    plan = books.plan_store(key(1), HOST)
    with books.held() as b:
        b.stack.finish(plan.key, plan.dst, True)
    assert books.pin_prefix([key(1)], HOST) == [(key(1), Location(HOST, 0))]
    assert books.plan_put(key(2)) is Skip.NO_ROOM  # the one slot is pinned
    books.unpin([(key(1), Location(HOST, 0))])
    assert isinstance(books.plan_put(key(2)), StorePlan)  # key 1 evicted


def test_hold_and_discard():
    books = books_of()
    plan = books.plan_store(key(1), DISK)
    with books.held() as b:
        b.stack.finish(plan.key, plan.dst, True)
    assert books.hold(DISK, key(1)) and not books.hold(DISK, key(2))
    assert books.discard(key(1)) == 1
    assert books.slot_of(DISK, key(1)) is None


def test_counts_and_failures_show_in_the_snapshot():
    books = books_of()
    books.count("chunks_stored", 3)
    books.failed("load_timeouts", "test timed_out", "no answer")
    books.got([HOST, HOST, DISK], wanted=5)
    books.account_write(IOResult(IOStatus.OK, nbytes=7))
    stats = books.snapshot(with_disk=True, shared=FollowedCounts(1, 2, 3, 4), remote=(True, 0))
    assert stats.chunks_stored == 3 and stats.load_timeouts == 1
    assert stats.chunks_loaded == {HOST: 2, DISK: 1} and stats.chunks_missed == 2
    assert (stats.disk_writes, stats.disk_write_bytes) == (1, 7)
    assert (stats.shared_chunks, stats.shared_writers, stats.shared_reclaimed,
            stats.shared_seats_freed) == (1, 2, 3, 4)
    assert stats.remote_down and set(stats.evictions) == {"host", "disk"}
    assert set(books.snapshot(with_disk=False).evictions) == {"host"}
    books.count("chunks_stored")
    assert stats.chunks_stored == 3, "a snapshot is a copy"


def test_census_counts_slots_and_chunks_per_tier():
    books = books_of()
    plan = books.plan_store(key(1), HOST)
    with books.held() as b:
        b.stack.finish(plan.key, plan.dst, True)
    assert books.census(with_disk=True) == ({"host": 2, "disk": 4}, {"host": 1, "disk": 0})
    assert books.census(with_disk=False) == ({"host": 2}, {"host": 1})


class FakeLane:
    """Paths that go down and come back, as a ``DiskLane`` reports them."""

    num_slots = 4

    def __init__(self) -> None:
        self.roots = ["/a", "/b"]
        self.down: dict[int, str] = {}

    def newly_down(self) -> dict[int, str]:
        down, self.down = self.down, {}
        return down

    def slots_of_path(self, index: int) -> range:
        return range(2 * index, 2 * index + 2)

    def note_timeout(self, slot: int) -> bool:
        self.down[slot // 2] = "timed out"
        return True

    def note_failure(self, result: IOResult, op: str) -> str | None:
        return None if result.status is IOStatus.PATH_DOWN else "io_errors"


def test_paths_down_are_retired_and_come_back():
    lane = FakeLane()
    books = books_of(lane=lane)
    plan = books.plan_store(key(1), DISK)
    assert plan.dst.slot == 0
    books.abort([(plan.key, plan.dst)])
    books.timed_out(1, "disk read timed_out", "no answer")  # path 0 goes down
    stats = books.snapshot(with_disk=True)
    assert stats.paths_down == {"/a": "timed out"} and stats.load_timeouts == 1
    assert all(books.plan_store(key(i), DISK).dst.slot >= 2 for i in (2, 3))
    assert books.plan_store(key(4), DISK) is None  # path 0's slots are out of service
    with books.held() as held:
        more = held.path_back(0)  # the lane calls it with the lock held
    while more is not None and more():  # then its slots back a share a hold (lock taken)
        pass
    assert books.snapshot(with_disk=True).paths_back == 1
    assert books.plan_store(key(5), DISK).dst.slot in (0, 1)
    lane.down = {1: "gone"}
    books.retire_down_paths()
    assert books.snapshot(with_disk=True).paths_down == {"/b": "gone"}


def test_a_failed_write_is_counted_by_its_kind():
    books = books_of(lane=FakeLane())
    books.account_write(IOResult(IOStatus.IO_ERROR))
    assert books.snapshot(with_disk=True).io_errors == 1


def test_open_books_shares_its_lock_with_the_lane_only():
    shared: list = []

    def open_lane(lock, on_back, failures):
        shared.append((lock, on_back))
        return FakeLane()

    books = open_books(open_lane, lambda lane: [(DISK, SlotIndex(lane.num_slots, LRUPolicy()))])
    lock, on_back = shared[0]
    assert isinstance(lock, type(threading.Lock()))
    with books.held():
        assert lock.locked()  # the same lock
        on_back(0, [])
    assert not lock.locked() and books.snapshot(with_disk=True).paths_back == 1


def test_the_lock_is_not_reentrant_so_held_blocks_are_never_nested():
    books = books_of()
    with books.held():
        done = threading.Event()
        thread = threading.Thread(target=lambda: (books.count("chunks_stored"), done.set()))
        thread.start()
        assert not done.wait(0.05), "a method waits for the held block"
    thread.join(5)
    assert done.is_set()


@pytest.mark.parametrize("name", ["lock", "stack", "stats", "failures", "top"])
def test_store_state_no_longer_holds_what_books_owns(name):
    from kvtier.store.state import StoreState
    assert name not in StoreState.__dataclass_fields__
