"""Looks at disk paths bounded in time, one at most under way per path and kind
(``kvtier/io/root_looks.py``): a path whose look hangs is passed over at once afterwards,
and no thread more is left behind it."""

import threading

from kvtier.io.root_looks import look_at_roots, under_way
from tests.helpers.disk_helpers import wait_until


def test_a_hung_look_is_missing_and_not_started_again_until_it_ends():
    release, calls = threading.Event(), []

    def look(root):
        calls.append(root)
        if root == "hung":
            release.wait(30)
        return root.upper()

    try:
        assert look_at_roots(["ok", "hung"], look, 0.2, "test-look") == {"ok": "OK"}
        assert under_way("test-look") == ["hung"] and under_way("other-kind") == []
        assert look_at_roots(["ok", "hung"], look, 0.2, "test-look") == {"ok": "OK"}
        assert calls.count("hung") == 1, "a second thread was left behind the hung path"
    finally:
        release.set()
    wait_until(lambda: under_way("test-look") == [], "the hung look to end")
    assert look_at_roots(["hung"], look, 5.0, "test-look") == {"hung": "HUNG"}


def test_what_a_look_raises_is_returned_by_its_root():
    def look(root):
        raise PermissionError(root)

    got = look_at_roots(["a"], look, 5.0, "test-look-raises")
    assert isinstance(got["a"], PermissionError) and under_way("test-look-raises") == []


def test_a_late_look_is_under_way_until_what_it_left_is_dealt_with():
    """A late open's directory still holds its segment's lock until ``left_over`` closed
    it: until then the path is not looked at (opened) again beside it."""
    release, closing, closed = threading.Event(), threading.Event(), threading.Event()

    def left_over(got):
        closing.set()
        closed.wait(30)

    try:
        assert look_at_roots(["slow"], lambda root: release.wait(30) and root, 0.1,
                             "test-look-left", left_over) == {}
        release.set()
        wait_until(closing.is_set, "the late look to hand over what it opened")
        assert under_way("test-look-left") == ["slow"]
    finally:
        release.set()
        closed.set()
    wait_until(lambda: under_way("test-look-left") == [], "the late look to be over")


def test_a_path_with_a_look_past_its_deadline_is_not_looked_at_by_any_kind():
    """A path whose open hung is not waited for again by every other look at it (the
    scheduler side's writer ids, its index files): any kind passes it over at once."""
    from kvtier.io.root_looks import stuck

    release, calls = threading.Event(), []

    def look(root):
        calls.append(root)
        release.wait(30)
        return root

    try:
        assert look_at_roots(["p"], look, 0.1, "test-kind-a") == {} and stuck("p")
        assert look_at_roots(["p", "q"], lambda root: root, 5.0, "test-kind-b") == {"q": "q"}
        assert calls == ["p"] and not stuck("q")
    finally:
        release.set()
    wait_until(lambda: not stuck("p"), "the look past its deadline to end")
    assert look_at_roots(["p"], lambda root: root, 5.0, "test-kind-b") == {"p": "p"}


def test_a_look_started_after_a_late_one_ended_is_not_taken_for_it(monkeypatch):
    """The first caller's look ends late just as it goes on, and another caller starts a
    fresh look of the same kind: the fresh look is not marked past its deadline (it would
    make every other look pass the path over while it runs)."""
    from kvtier.io import root_looks
    from kvtier.io.root_looks import stuck

    real, first, second, fresh = root_looks.run_bounded, threading.Event(), threading.Event(), []

    def then_a_fresh_look(jobs, wait, name, left_over=None):
        done = real(jobs, wait, name, left_over)
        if not fresh:
            first.set()  # the first look ends late now...
            wait_until(lambda: under_way("test-fresh") == [], "the late look to end")
            thread = threading.Thread(target=lambda: fresh.append(look_at_roots(
                ["p"], lambda root: second.wait(30) and root, 30.0, "test-fresh")))
            fresh.append(thread)  # ...and another caller looks at the path afresh
            thread.start()
            wait_until(lambda: under_way("test-fresh") == ["p"], "the fresh look to start")
        return done

    monkeypatch.setattr(root_looks, "run_bounded", then_a_fresh_look)
    try:
        assert look_at_roots(["p"], lambda root: first.wait(30) and root, 0.1, "test-fresh") == {}
        assert not stuck("p")
    finally:
        second.set()
    fresh[0].join(30)
    assert fresh[1:] == [{"p": "p"}]


def test_what_a_late_look_raises_is_logged(caplog):
    """Its caller went on without it: what it raised is said in the log, not lost."""
    import logging

    release = threading.Event()

    def look(root):
        release.wait(30)
        raise PermissionError(f"{root}: denied")

    with caplog.at_level(logging.INFO, logger="kvtier"):
        assert look_at_roots(["late"], look, 0.1, "test-look-late-raises") == {}
        release.set()
        wait_until(lambda: under_way("test-look-late-raises") == [], "the late look to end")
    assert any("late: denied" in r.getMessage() and "test-look-late-raises" in r.getMessage()
               for r in caplog.records)
