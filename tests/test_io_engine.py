"""The I/O engine's contract: submit never blocks, poll, pending, drain, bounded close."""

import threading
import time
from concurrent.futures import CancelledError

import pytest

from kvtier.io.engine import IOEngine
from tests.disk_helpers import wait_until


def test_submit_returns_at_once_and_poll_reports_tagged_jobs():
    engine = IOEngine(["a", "b"], 2)
    gate = threading.Event()
    started = time.monotonic()
    held = engine.submit("a", lambda: gate.wait(10) and "held", tag="held")
    engine.submit("b", lambda: 1 / 0, tag="broken")
    untagged = engine.submit("b", lambda: "quiet")
    assert time.monotonic() - started < 1  # nothing waited for the held job
    assert untagged.result(5) == "quiet"
    assert engine.pending("a") == 1
    gate.set()
    assert engine.drain(5) and engine.pending() == 0 and held.result() == "held"
    completions = {c.tag: c for c in engine.poll()}
    assert set(completions) == {"held", "broken"}  # untagged jobs are not reported
    assert completions["held"].value == "held" and completions["held"].error is None
    assert isinstance(completions["broken"].error, ZeroDivisionError)
    assert engine.poll() == []
    assert engine.close(1)


def test_jobs_of_one_queue_run_in_parallel_on_its_threads():
    engine = IOEngine(["a"], 3)
    barrier = threading.Barrier(3, timeout=5)
    futures = [engine.submit("a", barrier.wait) for _ in range(3)]
    assert sorted(f.result(10) for f in futures) == [0, 1, 2]  # all three met at once
    assert engine.close()


def test_close_waits_for_every_job_when_they_end_in_time():
    engine = IOEngine(["a"], 1)
    done = []
    for i in range(5):
        engine.submit("a", lambda i=i: time.sleep(0.01) or done.append(i))
    assert engine.close(10)
    assert done == [0, 1, 2, 3, 4]


def test_close_with_a_hung_job_returns_in_time_and_cancels_the_queued_ones():
    engine = IOEngine(["a", "b"], 1)
    release = threading.Event()
    hung = engine.submit("a", lambda: release.wait(30), tag="hung")
    queued = [engine.submit("a", lambda: "never", tag=f"q{i}") for i in range(3)]
    other = engine.submit("b", lambda: time.sleep(0.05) or "other")
    started = time.monotonic()
    try:
        assert engine.close(0.3) is False
        assert time.monotonic() - started < 5
        assert other.result() == "other"  # a healthy queue's job still finished
        assert all(f.cancelled() for f in queued) and not hung.done()
        cancelled = {c.tag: c.error for c in engine.poll()}
        assert set(cancelled) == {"q0", "q1", "q2"}
        assert all(isinstance(e, CancelledError) for e in cancelled.values())
        with pytest.raises(RuntimeError):
            engine.submit("a", lambda: None)
    finally:
        release.set()
    assert hung.result(5) is True  # the running job ends on its own
    wait_until(lambda: engine.pending() == 0, "the ended job still counted as pending")


def test_threads_per_queue_must_be_positive():
    with pytest.raises(ValueError, match="threads_per_queue"):
        IOEngine(["a"], 0)
