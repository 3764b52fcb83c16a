"""Jobs run at once on threads of their own and waited for until a deadline
(``kvtier/io/bounded_jobs.py``): what is not over is left behind, never waited for."""

import threading

from kvtier.io import bounded_jobs
from kvtier.io.bounded_jobs import path_job_wait, run_bounded
from tests.helpers.disk_helpers import wait_until


def test_what_ended_is_returned_and_what_did_not_is_missing():
    release = threading.Event()
    try:
        got = run_bounded({"quick": lambda: 1, "stuck": lambda: release.wait(60),
                           "raises": lambda: 1 / 0}, 0.3, "test-jobs")
        assert set(got) == {"quick", "raises"} and got["quick"] == 1
        assert isinstance(got["raises"], ZeroDivisionError)
    finally:
        release.set()


def test_without_a_wait_every_job_is_waited_for():
    gate = threading.Event()
    threading.Timer(0.2, gate.set).start()
    assert run_bounded({"late": lambda: gate.wait(30)}, None, "test-jobs") == {"late": True}


def test_a_job_whose_thread_cannot_start_runs_on_the_callers(monkeypatch):
    monkeypatch.setattr(bounded_jobs, "start_thread", lambda thread: False)
    here = threading.get_ident()
    assert run_bounded({"a": threading.get_ident}, 1.0, "test-jobs") == {"a": here}


def test_a_start_waits_for_a_read_back_a_few_load_timeouts_and_no_less_than_a_floor():
    assert path_job_wait(None) is None
    assert path_job_wait(0.001) == bounded_jobs.PATH_JOB_MIN_S
    assert path_job_wait(600) == 600 * bounded_jobs.PATH_JOB_TIMES


def test_what_a_job_left_behind_returns_later_is_handed_to_left_over_and_nothing_else():
    """A job given up on may have opened something (a path's segment, locked): what it
    returns or raises once it ends goes to ``left_over`` on its thread, never to the
    caller; a job that ended in time hands over nothing."""
    release, handed = threading.Event(), []
    got = run_bounded({"quick": lambda: "q", "late": lambda: release.wait(30) and "l",
                       "late-raise": lambda: release.wait(30) and 1 / 0},
                      0.2, "test-jobs", left_over=lambda key, outcome: handed.append((key, outcome)))
    assert got == {"quick": "q"}
    release.set()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "test-jobs"],
               "the jobs left behind to end")
    assert sorted(key for key, _ in handed) == ["late", "late-raise"]
    assert dict(handed)["late"] == "l" and isinstance(dict(handed)["late-raise"], ZeroDivisionError)
