"""The scheduler side's questions to the remote store (``RemotePresence``), against a fake
store whose lookups block until released: a scheduler step's inline waits, the questions
out at once, questions of forgotten requests, and chunks whose load failed."""

import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvtier.connector.scheduler import remote_presence
from kvtier.connector.scheduler.remote_distrust import DistrustedKeys
from kvtier.connector.scheduler.remote_presence import INLINE_WAIT_S, MAX_QUESTIONS, RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.keys import ChunkKey

A, B, C = ChunkKey(b"a"), ChunkKey(b"b"), ChunkKey(b"c")


class Store:
    """A remote tier that holds every chunk; its lookups wait for ``release``."""

    down = False

    def __init__(self, blocked: bool = False) -> None:
        self.release = threading.Event()
        if not blocked:
            self.release.set()
        self.asked: list[list[bytes]] = []  # each lookup's keys, as it started
        self._lock = threading.Lock()

    def exists(self, keys):
        with self._lock:
            self.asked.append(list(keys))
        assert self.release.wait(30), "the test never released the store"
        return [True] * len(keys)

    def exists_answered(self, keys):
        held = self.exists(keys)
        return None if self.down else held

    def close(self):
        self.release.set()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def answer(presence: RemotePresence, req_id: str, keys) -> list[bool]:
    """The answer, once the store gave it (the scheduler asks again each step)."""
    until(lambda: presence.held(req_id, keys) is not None)
    found = presence.held(req_id, keys)
    assert found is not None
    return found


@pytest.fixture
def waits(monkeypatch):
    """The timeout of each wait a ``held`` call makes on the step."""
    timeouts: list[float] = []
    real = remote_presence.wait_futures

    def wait(futures, timeout=None):
        timeouts.append(timeout)
        return real(futures, timeout=timeout)

    monkeypatch.setattr(remote_presence, "wait_futures", wait)
    return timeouts


def test_a_step_waits_on_the_store_at_most_its_allowance_in_all(waits):
    store = Store(blocked=True)
    presence = RemotePresence([store], wait_s=30)
    try:
        for n in range(20):  # one scheduler step meets 20 new requests
            assert presence.held(f"r{n}", [ChunkKey(b"%d" % n)]) is None
        # the first waited its 2 ms; the others had (next to) nothing left to wait
        assert waits[0] == INLINE_WAIT_S and sum(waits) <= 1.5 * INLINE_WAIT_S
        presence.next_step()  # the next step waits again, as long
        waits.clear()
        assert presence.held("q", [A]) is None
        assert waits == [INLINE_WAIT_S]
    finally:
        presence.close()


def test_the_scheduler_side_renews_the_allowance_at_each_step(waits):
    """vLLM asks about its waiting requests, then builds the step's plan: that ends a step."""
    from tests.helpers.scheduler_side import CHUNK, request, scheduler

    side = scheduler(remote_url="redis://127.0.0.1:1")  # never reached: a fake store asks
    assert side.presence is not None
    for tier in side.presence.tiers:
        tier.close()
    side.presence.tiers = [Store(blocked=True)]
    try:
        for step in range(3):
            waits.clear()
            for n in range(5):
                assert side.num_new_matched_tokens(request(f"r{step}.{n}", 2 * CHUNK + 1,
                                                           seed=10 * step + n), 0) == (None, False)
            assert waits[0] == INLINE_WAIT_S and sum(waits) <= 1.5 * INLINE_WAIT_S
            side.build_meta()
    finally:
        side.close()


def test_a_step_meeting_many_new_requests_returns_while_the_store_hangs(monkeypatch):
    store = Store(blocked=True)
    presence = RemotePresence([store], wait_s=30, max_questions=2000)  # every one is sent
    waits, real_wait = [], remote_presence.wait_futures

    def wait(futures, timeout):
        waits.append(timeout)
        return real_wait(futures, timeout=timeout)

    monkeypatch.setattr(remote_presence, "wait_futures", wait)
    try:
        answers = [presence.held(f"r{n}", [ChunkKey(b"%d" % n)]) for n in range(1000)]
        assert answers == [None] * 1000 and not store.release.is_set()
        # the step's inline waits, all of them, fit its budget (not 2 ms each: 2 s)
        assert waits and sum(waits) <= INLINE_WAIT_S * 1.01
    finally:
        presence.close()


def test_questions_out_are_bounded_and_the_rest_wait_their_turn():
    store = Store(blocked=True)
    presence = RemotePresence([store], wait_s=30, max_questions=4)
    try:
        assert MAX_QUESTIONS >= 4
        assert [presence.held(f"r{n}", [A]) for n in range(10)] == [None] * 10
        assert presence.lookups == 4 and presence.questions_out == 4
        store.release.set()
        until(lambda: presence.questions_out == 0)
        assert presence.held("r0", [A]) == [True]
        assert answer(presence, "r9", [A]) == [True]  # sent once there was room
        assert presence.lookups == 5
    finally:
        presence.close()


def test_a_question_that_never_found_room_counts_as_none_after_wait_s():
    store = Store(blocked=True)
    presence = RemotePresence([store], wait_s=0.05, max_questions=1)
    try:
        assert presence.held("r0", [A]) is None
        assert presence.held("r1", [B]) is None  # no room: not sent
        time.sleep(0.06)
        assert presence.held("r1", [B]) == [False]
        store.release.set()
        until(lambda: presence.questions_out == 0)
        assert presence.held("r1", [B]) == [False] and presence.lookups == 1  # never sent
    finally:
        presence.close()


def test_questions_of_forgotten_requests_are_never_sent():
    store = Store(blocked=True)
    presence = RemotePresence([store], wait_s=30)
    try:
        for n in range(10):
            presence.held(f"r{n}", [ChunkKey(b"%d" % n)])
        until(lambda: len(store.asked) == 2)  # both lookup threads are on the store
        for n in range(10):
            presence.forget(f"r{n}")
        store.release.set()
        assert answer(presence, "probe", [A]) == [True]  # queued after the forgotten ones
        assert sorted(store.asked) == [[b"0"], [b"1"], [b"a"]]
        until(lambda: presence.questions_out == 0)
    finally:
        presence.close()


def test_a_chunk_whose_load_failed_is_not_held_for_its_request_again():
    clock = Clock()
    presence = RemotePresence([Store()], wait_s=30, distrusted=DistrustedKeys(60, 16, clock))
    try:
        assert answer(presence, "r", [A, B]) == [True, True]
        presence.failed("r", [B], damaged=[B])
        assert presence.held("r", [A, B]) == [True, False]
        # the store still says it holds B: another request does not trust it for a while
        assert answer(presence, "q", [A, B]) == [True, False]
        clock.now = 61
        assert answer(presence, "q2", [A, B]) == [True, True]
        # the request whose load failed never trusts it again, even asking about more keys
        assert answer(presence, "r", [A, B, C]) == [True, False, True]
    finally:
        presence.close()


def test_a_chunk_whose_read_failed_on_its_way_is_distrusted_only_until_the_store_is_tried_again():
    """A read that timed out, or found the workers' store out of service, says nothing of
    the value: another request trusts the chunk again after ``retry_s`` (the workers' wait
    before they try the store again), not ``DISTRUST_S``; its own request never does."""
    clock = Clock()
    presence = RemotePresence([Store()], wait_s=30, distrusted=DistrustedKeys(60, 16, clock),
                              retry_s=10)
    try:
        assert answer(presence, "r", [A, B, C]) == [True, True, True]
        presence.failed("r", [B, C], damaged=[C])  # B timed out, C failed its checks
        assert answer(presence, "q", [A, B, C]) == [True, False, False]
        clock.now = 11
        assert answer(presence, "q2", [A, B, C]) == [True, True, False]
        assert presence.held("r", [A, B, C]) == [True, False, False]
        clock.now = 61
        assert answer(presence, "q3", [A, B, C]) == [True, True, True]
        presence.failed("q3", [C], damaged=[C])  # damaged: a minute
        presence.failed("q4", [C])  # then a read of it timed out: no shorter for it
        clock.now = 61 + 11
        assert answer(presence, "q5", [A, C]) == [True, False]
    finally:
        presence.close()


def test_distrusted_keys_expire_and_are_bounded():
    clock = Clock()
    keys = DistrustedKeys(ttl_s=10, capacity=2, clock=clock)
    keys.add([A])
    clock.now = 5
    keys.add([B, A])  # A again: ten more seconds
    assert A in keys and B in keys and b"zz" not in keys and 3 not in keys
    keys.add([C])  # past the capacity: the oldest (B) is forgotten
    assert len(keys) == 2 and B not in keys and A in keys
    clock.now = 15
    assert A not in keys and C not in keys and len(keys) == 0


class Holding(Store):
    """A store that holds only the chunks of ``held``, and is down when told."""

    def __init__(self, held) -> None:
        super().__init__()
        self.held = set(held)

    def exists(self, keys):
        super().exists(keys)
        return [key in self.held for key in keys]


def writes_told_by(presence: RemotePresence) -> RemoteWrites:
    """The scheduler side's remote writes (a store per chunk planned, nothing pinned)."""
    return RemoteWrites(SimpleNamespace(indexes={}, locate=lambda key: None), Counter(), 1, 0, 8,
                        lambda: presence.down,
                        presence.take_absent)


def test_a_chunk_the_store_answers_not_there_is_written_again_at_its_next_store():
    store = Holding([A])
    presence = RemotePresence([store], wait_s=30)
    writes = writes_told_by(presence)
    try:
        writes.in_store(A)
        writes.in_store(B)  # both read from the store once: not written again
        assert not writes.with_store(A) and not writes.with_store(B)
        assert answer(presence, "r", [A, B]) == [True, False]  # B lost (a restart, an eviction)
        assert writes.with_store(B) and not writes.with_store(A)
        assert presence.take_absent() == []  # taken once
    finally:
        presence.close()


def test_a_failed_lookup_makes_no_chunk_forgotten():
    store = Holding([])
    presence = RemotePresence([store], wait_s=30)
    writes = writes_told_by(presence)
    try:
        writes.in_store(A)
        store.down = True  # what a failed round trip leaves: the tier out of service
        presence._ask([A])  # white-box: the question a step sent, as it ran
        assert not writes.with_store(A)
    finally:
        presence.close()


class Refusing(Holding):
    """A cluster whose node redirects the lookup of ``moved`` (a slot moving): no answer
    for that key alone."""

    def __init__(self, held, moved) -> None:
        super().__init__(held)
        self.moved = set(moved)

    def exists_answered(self, keys):
        held = self.exists(keys)
        return [None if key in self.moved else there for key, there in zip(keys, held, strict=True)]


def test_a_key_the_store_refused_to_answer_for_is_a_miss_not_a_loss():
    store = Refusing([A], moved=[B])
    presence = RemotePresence([store], wait_s=30)
    writes = writes_told_by(presence)
    try:
        writes.in_store(B)
        assert answer(presence, "r", [A, B]) == [True, False]  # B: a miss this time
        assert presence.take_absent() == []
        assert not writes.with_store(B)  # still known to be there: not written again
    finally:
        presence.close()
