"""Whether offload pays, per tier (``Payoff``): each load's seconds, the slowest rank's,
against the prefill its tokens saved, counted under the coldest tier it read from; a tier
that stops paying is said once, and once when it pays again; and the workers' reports carry
each load's time through a scheduler side to its metrics."""

import logging
from collections import Counter

from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler.payoff import MIN_LOADS, Payoff, coldest
from kvtier.tiers.base import TierName

HOST, DISK, SHARED, REMOTE = TierName.HOST, TierName.DISK, TierName.SHARED, TierName.REMOTE


def test_a_load_counts_under_the_coldest_tier_it_read_from():
    assert coldest({HOST: 512, DISK: 256}) is DISK
    assert coldest({HOST: 512, REMOTE: 256, SHARED: 256}) is REMOTE
    assert coldest({HOST: 0}) is None and coldest({}) is None


def test_seconds_taken_and_saved_add_up_by_tier_the_slowest_rank_counting():
    payoff = Payoff(Counter(), lambda: 0.001)  # 1 ms of prefill a token
    payoff.took("r", 0.05)
    payoff.took("r", 0.2)  # the other rank
    payoff.over("r", {HOST: 256, DISK: 768})
    payoff.took("s", 0.1)
    payoff.over("s", {HOST: 512})
    assert payoff.load_s == {DISK: 0.2, HOST: 0.1}
    assert payoff.saved_s == {DISK: 1.024, HOST: 0.512}


def test_nothing_is_counted_before_the_prefill_speed_is_known_or_for_an_untimed_load():
    speed = [None]
    payoff = Payoff(Counter(), lambda: speed[0])
    payoff.took("r", 0.5)
    payoff.over("r", {DISK: 256})
    payoff.over("q", {DISK: 256})  # no time reported
    speed[0] = 0.001
    payoff.took("s", 0.5)
    payoff.over("s", {})  # read nothing
    assert payoff.load_s == {} and payoff.saved_s == {}


def test_a_tier_that_stops_paying_is_said_once_and_once_when_it_pays_again(caplog):
    counters = Counter()
    payoff = Payoff(counters, lambda: 0.001)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        for i in range(MIN_LOADS + 5):  # 1 s a load of 256 tokens: 0.256 s saved
            payoff.took(f"r{i}", 1.0)
            payoff.over(f"r{i}", {DISK: 256})
        warned = [r for r in caplog.records if "recomputing is faster" in r.getMessage()]
        assert len(warned) == 1 and "disk" in warned[0].getMessage()
        assert warned[0].levelno == logging.WARNING
        for i in range(200):  # fast loads now: 1 ms each
            payoff.took(f"f{i}", 0.001)
            payoff.over(f"f{i}", {DISK: 256})
    assert len([r for r in caplog.records if "pay again" in r.getMessage()]) == 1
    assert counters["timed_loads_disk"] == MIN_LOADS + 205


def test_a_report_keeps_the_slowest_ranks_time_of_each_load():
    a = WorkerReport(load_seconds={"r": 0.1, "s": 0.4})
    b = WorkerReport(load_seconds={"r": 0.3})
    assert a.merged(b).load_seconds == {"r": 0.3, "s": 0.4}
    assert not WorkerReport().merged(WorkerReport()).load_seconds
    assert not WorkerReport(load_seconds={"r": 0.1}).is_empty()


def test_a_schedulers_load_time_reaches_its_metrics_by_tier():
    from tests.helpers.scheduler_side import request, scheduler, store_all

    side = scheduler()
    try:
        store_all(side, request("x", 64))  # two chunks in host memory
        side.decider.prefill_seconds_per_token.value = 0.001
        assert side.num_new_matched_tokens(request("y", 65), 0) == (64, False)
        side.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
        side.build_meta()
        side.worker_report(WorkerReport(loads_done=Counter({"y": 1}), load_seconds={"y": 0.02}))
        samples = {s.name: s for s in side.metric_samples()}
        assert samples["load_seconds_total"].values[(("tier", "host"),)] == 0.02
        assert abs(samples["seconds_saved_total"].values[(("tier", "host"),)] - 0.064) < 1e-9
        assert set(samples["load_seconds_total"].values) == {(("tier", "host"),)}  # no disk here
    finally:
        side.close()
