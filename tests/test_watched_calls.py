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


def submitted(calls: WatchedCalls, what: str, call, holds_memory: bool, answers: list) -> threading.Thread:
    """``calls.run`` on a thread of its own (its answer, or what it raised, into
    ``answers``), returned once the call is listed (queued or running)."""
    before = len(calls._running)

    def run():
        try:
            answers.append(calls.run(what, call, holds_memory=holds_memory))
        except BaseException as exc:
            answers.append(exc)
    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 10
    while len(calls._running) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return runner


def test_a_call_queued_behind_calls_within_their_deadlines_fails_alone_and_nothing_is_late():
    """Every thread busy with a healthy store's calls: the one still queued at its deadline
    is not the store's fault. It fails alone (``CallsBusy``), the tier hears nothing."""
    from kvtier.remote.watched_calls import CallsBusy

    late, first, second, ran = Late(), threading.Event(), threading.Event(), threading.Event()
    calls = WatchedCalls(2.0, late, threads=1)
    answers: list = []
    runners = [submitted(calls, "get", blocked(first, "a"), True, answers),
               submitted(calls, "get", blocked(second, "b"), True, answers),
               submitted(calls, "exists", ran.set, False, answers)]
    time.sleep(1.0)
    first.set()  # the first ends in time; the second runs from now, well within its deadline
    runners[2].join(10)  # the lookup's deadline: the second 1 s into its 2 s
    second.set()
    for runner in runners:
        runner.join(10)
    assert answers[0::2] == ["a", "b"] and isinstance(answers[1], CallsBusy)  # in that order
    assert "not started within 2 s" in str(answers[1])
    assert late.calls == [] and calls.late == 0
    assert not ran.is_set()
    calls.close()


def test_a_call_that_started_late_has_its_own_deadline_from_its_start():
    late, first, second = Late(), threading.Event(), threading.Event()
    calls = WatchedCalls(2.0, late, threads=1)
    answers: list = []
    runner = submitted(calls, "get", blocked(first, "a"), True, answers)
    lookup = submitted(calls, "exists", blocked(second, "held"), False, answers)
    time.sleep(1.5)
    first.set()  # the lookup starts 1.5 s after it was asked
    time.sleep(1.0)
    second.set()  # 2.5 s after it was asked, 1 s after it started: an answer in time
    for thread in (runner, lookup):
        thread.join(10)
    assert answers == ["a", "held"] and late.calls == [] and calls.late == 0
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


def test_a_call_running_before_its_start_was_noted_is_waited_for_as_running(monkeypatch):
    """The pool sets a call running before it notes its start: a caller whose wait ended in
    between found it neither queued nor started (an AssertionError, which took the tier
    out while the transfer went on in caller memory). It is waited for as running."""
    from kvtier.remote import watched_calls

    noted = watched_calls._Running.run

    def slow_to_note(self, call):
        time.sleep(0.3)  # the caller's 0.2 s wait ends before the start is noted
        return noted(self, call)
    monkeypatch.setattr(watched_calls._Running, "run", slow_to_note)
    late = Late()
    calls = WatchedCalls(0.2, late)
    assert calls.run("get", lambda: "bytes", holds_memory=True) == "bytes"
    assert late.calls == [] and calls.late == 0
    calls.close()
