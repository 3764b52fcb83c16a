"""Folding reports over TP ranks: outcomes and up/down counts."""

from kvtier.connector.scheduler.rank_counts import RankCount, RankOutcomes


def test_outcomes_wait_for_every_rank_then_say_whether_any_failed():
    outcomes = RankOutcomes(world_size=2)
    assert outcomes.add("k", 1, 0) is None  # rank 1 still to report
    assert outcomes.add("k", 1, 0) is True
    assert outcomes.add("k", 0, 1) is None  # forgotten after the answer: a new round
    assert outcomes.add("k", 1, 0) is False


def test_counts_say_when_they_rise_from_and_fall_to_zero():
    count = RankCount()
    assert count.up("p", 1) and not count.up("p", 1) and count["p"] == 2
    assert not count.down("p", 1) and count.down("p", 1) and count["p"] == 0
    assert not count.reached("r", 1, 2) and count.reached("r", 1, 2) and count["r"] == 0
