"""Jobs run at once on threads of their own and waited for until a deadline
(``kvtier/io/bounded_jobs.py``): what is not over is left behind, never waited for."""

import threading

from kvtier.io import bounded_jobs
from kvtier.io.bounded_jobs import read_back_wait, run_bounded


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
    assert read_back_wait(None) is None
    assert read_back_wait(0.001) == bounded_jobs.READ_BACK_MIN_S
    assert read_back_wait(600) == 600 * bounded_jobs.READ_BACK_TIMES
