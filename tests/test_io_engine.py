"""The I/O engine's contract (``IOExecutor``), for the production engine and the tests' fake:
submit never blocks, pending, drain, bounded close."""

import threading
import time

import pytest

from kvtier.io.engine import IOEngine
from kvtier.io.guarded import cancel
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine

ENGINES = pytest.mark.parametrize("make", [IOEngine, FakeEngine])


@ENGINES
def test_submit_returns_at_once_and_futures_carry_values_and_errors(make):
    engine = make(["a", "b"], 2)
    gate = threading.Event()
    started = time.monotonic()
    held = engine.submit("a", lambda: gate.wait(10) and "held")
    broken = engine.submit("b", lambda: 1 / 0)
    quiet = engine.submit("b", lambda: "quiet")
    assert time.monotonic() - started < 1  # nothing waited for the held job
    assert quiet.result(5) == "quiet"
    assert isinstance(broken.exception(5), ZeroDivisionError)
    assert engine.pending("a") == 1 and engine.pending() == 1
    gate.set()
    assert engine.drain(5) and engine.pending() == 0 and held.result() == "held"
    assert engine.close(1)


@ENGINES
def test_a_job_counts_until_the_callbacks_added_before_it_ended_have_run(make):
    """Owners give back what a job held (a host slot it read into, a pin) from its future's
    callbacks: once a drain returns True, or pending() reads 0, they have run. Else a put
    that drained the writes holding every host slot finds no room yet, and skips a chunk."""
    engine = make(["a"], 1)
    gate, in_callback, let_go, given_back = (threading.Event(), threading.Event(),
                                             threading.Event(), [])
    job = engine.submit("a", lambda: gate.wait(10))

    def give_back(_):
        in_callback.set()
        let_go.wait(10)
        given_back.append(True)

    job.add_done_callback(give_back)
    gate.set()
    assert in_callback.wait(5) and job.done()
    assert engine.pending() == 1 and engine.pending("a") == 1  # its callback still runs
    assert not engine.drain(0.1)
    let_go.set()
    assert engine.drain(5) and given_back == [True] and engine.pending() == 0
    assert engine.close(1)


@ENGINES
def test_a_job_cancelled_counts_until_the_cancels_callbacks_have_run(make):
    """A queued job cancelled (a path out of service, a close) gives back what it would have
    used from its future's callbacks, run by the cancel: counted until they are over."""
    engine = make(["a"], 1)
    gate, in_callback, let_go = threading.Event(), threading.Event(), threading.Event()
    held = engine.submit("a", lambda: gate.wait(10))
    queued = engine.submit("a", lambda: "never")

    def give_back(_):
        in_callback.set()
        let_go.wait(10)

    queued.add_done_callback(give_back)
    canceller = threading.Thread(target=cancel, args=(queued,))
    canceller.start()
    assert in_callback.wait(5) and queued.cancelled()
    assert engine.pending("a") == 2  # the cancelled job's callback still runs
    let_go.set()
    canceller.join(5)
    assert engine.pending("a") == 1 and not held.done()
    gate.set()
    assert engine.drain(5) and engine.pending() == 0
    assert engine.close(1)


@ENGINES
def test_a_job_cancelled_plainly_is_over_once_a_thread_reaches_it(make):
    """A ``Future.cancel`` not through ``guarded.cancel`` tells no one; the job still ends
    once a thread takes it from the queue, so a drain does not wait for it for ever."""
    engine = make(["a"], 1)
    gate = threading.Event()
    engine.submit("a", lambda: gate.wait(10))
    queued = engine.submit("a", lambda: "never")
    assert queued.cancel()
    gate.set()
    assert engine.drain(5) and engine.pending() == 0
    assert engine.close(1)


def test_a_job_for_an_unknown_queue_is_refused_and_never_counted():
    engine = IOEngine(["a"], 1)
    with pytest.raises(KeyError):
        engine.submit("b", lambda: None)
    assert engine.pending() == 0 and engine.drain(0) and engine.close(1)


@ENGINES
def test_jobs_of_one_queue_run_in_parallel_on_its_threads(make):
    engine = make(["a"], 3)
    barrier = threading.Barrier(3, timeout=5)
    futures = [engine.submit("a", barrier.wait) for _ in range(3)]
    assert sorted(f.result(10) for f in futures) == [0, 1, 2]  # all three met at once
    assert engine.close()


@ENGINES
def test_close_waits_for_every_job_when_they_end_in_time(make):
    engine = make(["a"], 1)
    done = []
    for i in range(5):
        engine.submit("a", lambda i=i: time.sleep(0.01) or done.append(i))
    assert not engine.closed
    assert engine.close(10)
    assert done == [0, 1, 2, 3, 4] and engine.closed


@ENGINES
def test_close_with_a_hung_job_returns_in_time_and_cancels_the_queued_ones(make):
    engine = make(["a", "b"], 1)
    release = threading.Event()
    hung = engine.submit("a", lambda: release.wait(30))
    queued = [engine.submit("a", lambda: "never") for _ in range(3)]
    other = engine.submit("b", lambda: time.sleep(0.05) or "other")
    started = time.monotonic()
    try:
        assert engine.close(0.3) is False
        assert time.monotonic() - started < 5
        assert other.result() == "other"  # a healthy queue's job still finished
        assert all(f.cancelled() for f in queued) and not hung.done() and engine.closed
        with pytest.raises(RuntimeError):
            engine.submit("a", lambda: None)
    finally:
        release.set()
    assert hung.result(5) is True  # the running job ends on its own
    wait_until(lambda: engine.pending() == 0, "the ended job still counted as pending")


def test_threads_per_queue_must_be_positive():
    with pytest.raises(ValueError, match="threads_per_queue"):
        IOEngine(["a"], 0)


def test_fake_engine_holds_and_fails_queues_on_demand():
    engine = FakeEngine(["a", "b"], 1)
    engine.hold("a")
    held = engine.submit("a", lambda: "late")
    assert engine.started.acquire(timeout=5)  # the job is waiting at the gate
    assert engine.submit("b", lambda: "free").result(5) == "free"
    assert not held.done()
    engine.release("a")
    assert held.result(5) == "late"
    engine.fail(OSError(5, "EIO"), "b")
    assert isinstance(engine.submit("b", lambda: "never").exception(5), OSError)
    assert engine.submitted == {"a": 1, "b": 2}
    assert engine.close(5)


@ENGINES
def test_a_job_may_submit_another_while_the_engine_closes(make):
    """A job submitting a follow-on job (a write group) while ``close`` cancels the queued
    ones: both return, the follow-on refused or run, never a deadlock."""
    engine = make(["a"], 2)
    release = threading.Event()
    outcomes: list[str] = []

    def chained():
        release.wait(10)
        for _ in range(200):
            try:
                engine.submit("a", lambda: None)
            except RuntimeError:
                outcomes.append("refused")
                return
        outcomes.append("ran")

    engine.submit("a", chained)
    queued = [engine.submit("a", lambda: release.wait(10)) for _ in range(20)]
    closer = threading.Thread(target=lambda: engine.close(0.2), daemon=True)
    closer.start()
    time.sleep(0.1)
    release.set()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close deadlocked against a job submitting"
    wait_until(lambda: outcomes, "the chained job never ended")
    assert outcomes in (["refused"], ["ran"]) and engine.closed
    wait_until(lambda: all(f.done() for f in queued), "a queued job neither ran nor was cancelled")
    with pytest.raises(RuntimeError):
        engine.submit("a", lambda: None)


def test_every_thread_starts_with_the_engine():
    before = set(threading.enumerate())  # (threads, not names: another test's may linger)
    engine = IOEngine(["a", "b"], 3)
    started = [t for t in threading.enumerate() if t not in before]
    assert len(started) == 6 and all(t.name.startswith("kvtier-io-") for t in started)
    assert engine.close(1)


def test_a_thread_that_cannot_start_fails_the_engine_and_lets_the_others_go(monkeypatch):
    real_start, calls = threading.Thread.start, []

    def start(thread):
        calls.append(thread)
        if len(calls) == 3:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    begun = time.monotonic()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        IOEngine(["a"], 4)
    monkeypatch.undo()
    wait_until(lambda: not [t for t in calls if t.is_alive()],
               "a thread started for the failed engine is still waiting")
    assert time.monotonic() - begun < 10  # not the barrier's own 30 s


def test_a_submit_that_raises_never_runs_its_job(monkeypatch):
    """The pool may queue a job and then fail to start a thread for it: the job must not run
    later, since its caller gives back the memory and slots it would use."""
    engine = IOEngine(["a"], 1)
    release, ran = threading.Event(), []
    busy = engine.submit("a", lambda: release.wait(10))
    pool = engine._pools["a"]

    def no_thread():
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pool, "_adjust_thread_count", no_thread)  # after the job is queued
    with pytest.raises(RuntimeError, match="can't start new thread"):
        engine.submit("a", lambda: ran.append("the refused job"))
    monkeypatch.undo()
    release.set()
    assert busy.result(5) is True
    assert engine.submit("a", lambda: "later").result(5) == "later"  # the queue ran past it
    assert ran == [] and engine.pending() == 0
    assert engine.close(1)
