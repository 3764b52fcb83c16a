"""One deadline over a client call that cannot be bounded from outside (``WatchedCalls``):
past it the tier hears at once; a call holding no memory is left behind, one moving bytes of
caller memory is waited for to its end, and one that never started is dropped."""

import threading
import time

import pytest

from kvtier.remote.watched_calls import WatchedCalls


class Late:
    def __init__(self):
        self.calls: list[tuple[str, BaseException]] = []
        self.heard = threading.Event()

    def __call__(self, what, exc):
        self.calls.append((what, exc))
        self.heard.set()


def blocked(release: threading.Event, answer="late"):
    def call():
        assert release.wait(20), "the test never released the call"
        return answer
    return call


def test_a_call_in_time_gives_its_answer_and_nothing_is_late():
    late = Late()
    calls = WatchedCalls(5.0, late)
    assert calls.run("get", lambda: [1, 2], holds_memory=True) == [1, 2]
    assert late.calls == [] and calls.late == 0
    calls.close()


def test_a_late_lookup_answers_none_at_its_deadline_and_is_left_to_end():
    late, release = Late(), threading.Event()
    calls = WatchedCalls(0.2, late)
    started = time.monotonic()
    assert calls.run("exists", blocked(release), holds_memory=False) is None
    assert time.monotonic() - started < 5
    assert [what for what, _ in late.calls] == ["exists"] and calls.late == 1
    assert isinstance(late.calls[0][1], TimeoutError) and "remote_timeout" in str(late.calls[0][1])
    release.set()
    calls.close()


def test_a_late_transfer_is_heard_at_its_deadline_and_waited_for_to_its_end():
    late, release = Late(), threading.Event()
    calls = WatchedCalls(0.2, late)
    answer: list[object] = []
    runner = threading.Thread(target=lambda: answer.append(
        calls.run("get", blocked(release, "bytes"), holds_memory=True)))
    runner.start()
    assert late.heard.wait(5), "the tier never heard of the late call"
    time.sleep(0.1)
    assert answer == [], "the caller got its memory back while the transfer still ran"
    release.set()
    runner.join(10)
    assert answer == ["bytes"]
    calls.close()


def test_a_call_still_queued_at_its_deadline_never_runs_and_the_tier_hears_of_it():
    """Its None must not read as an answer (a lookup's "none held": a loss): the tier
    hears of it as of a late call, and goes out of service."""
    late, release, ran = Late(), threading.Event(), threading.Event()
    calls = WatchedCalls(0.2, late, threads=1)
    first = threading.Thread(target=calls.run, args=("get", blocked(release)), kwargs={"holds_memory": True})
    first.start()
    assert late.heard.wait(5)
    assert calls.run("exists", ran.set, holds_memory=False) is None
    assert [what for what, _ in late.calls] == ["get", "exists"]
    assert "not started" in str(late.calls[1][1])
    release.set()
    first.join(10)
    time.sleep(0.1)
    assert not ran.is_set() and calls.late == 1
    calls.close()


def test_an_error_of_the_call_is_raised_to_its_caller():
    calls = WatchedCalls(5.0, Late())

    def refuse():
        raise ValueError("bad arguments")
    with pytest.raises(ValueError, match="bad arguments"):
        calls.run("put", refuse, holds_memory=True)
    calls.close()


def test_after_close_a_call_does_not_run():
    ran = threading.Event()
    calls = WatchedCalls(5.0, Late())
    calls.close()
    assert calls.run("get", ran.set, holds_memory=True) is None and not ran.is_set()


def test_the_client_is_closed_only_once_no_call_runs_in_it(monkeypatch):
    """A late lookup is left running on its thread, and may still call into the client:
    closing the client under it crashed the process (SIGSEGV in Mooncake's). ``close``
    waits for it, and releases the client only when it is over; one still running then
    leaves the client open until the process exits."""
    import kvtier.remote.watched_calls as watched

    late, release, closed = Late(), threading.Event(), []
    calls = WatchedCalls(0.2, late)
    assert calls.run("exists", blocked(release), holds_memory=False) is None  # late, running
    monkeypatch.setattr(watched, "CLOSE_WAIT_S", 0.3)
    assert calls.close(lambda: closed.append(1)) is False and closed == []
    release.set()
    calls = WatchedCalls(0.2, late)
    release2 = threading.Event()
    assert calls.run("exists", blocked(release2), holds_memory=False) is None
    threading.Timer(0.2, release2.set).start()  # it ends while close waits
    monkeypatch.setattr(watched, "CLOSE_WAIT_S", 10.0)
    assert calls.close(lambda: closed.append(1)) is True and closed == [1]
