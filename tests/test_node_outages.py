"""A Redis cluster's nodes out of service (``NodeOutages``), on a clock of the test's: a
node that failed is out for ``retry_s``; then one round trip at a time asks it (its trial),
the others answering its keys at once, until it answers, fails again, or ``retry_s`` passes
with no word of the trial (one that never reached it)."""

from kvtier.remote.node_outages import NodeOut, NodeOutages


def outages_at(now: list[float]) -> NodeOutages:
    return NodeOutages(5.0, "redis+cluster://test", clock=lambda: now[0])


def test_one_round_trip_at_a_time_asks_a_node_whose_outage_is_over():
    now = [0.0]
    outages = outages_at(now)
    assert outages.admit("a") is None and not outages.on_trial("a")  # never failed
    outages.failed("a", TimeoutError("no reply"))
    assert isinstance(outages.admit("a"), NodeOut) and outages.names() == ["a"]
    now[0] = 5.0
    assert outages.out("a") is None  # a look claims nothing
    assert outages.admit("a") is None and outages.on_trial("a")  # this round trip's trial
    for _ in range(3):  # every other round trip meanwhile: its keys answered at once
        assert isinstance(outages.admit("a"), NodeOut) and outages.out("a") is not None
    assert outages.names() == ["a"]
    outages.failed("a", TimeoutError("no reply"))  # the trial failed: out again
    assert not outages.on_trial("a") and isinstance(outages.admit("a"), NodeOut)
    now[0] = 10.0
    assert outages.admit("a") is None and isinstance(outages.admit("a"), NodeOut)
    outages.answered("a")  # the trial answered: back for every round trip
    assert outages.admit("a") is None and outages.admit("a") is None
    assert outages.names() == [] and not outages.on_trial("a")
    assert outages.failures == 2


def test_a_trial_that_never_reached_its_node_is_claimed_again_after_retry_s():
    now = [0.0]
    outages = outages_at(now)
    outages.failed("a", ConnectionRefusedError())
    now[0] = 5.0
    assert outages.admit("a") is None  # claimed; that round trip never asks it (its time ran out)
    now[0] = 9.9
    assert isinstance(outages.admit("a"), NodeOut)
    now[0] = 10.0
    assert outages.admit("a") is None and outages.on_trial("a")


def test_a_node_no_round_trip_asks_any_more_is_forgotten_once_another_fails():
    """A failed-over node's address is never asked again (the slot map moved on): its
    entry goes, so that nodes that came and went do not pile up in a long-lived engine."""
    from kvtier.remote import node_outages

    now = [0.0]
    outages = outages_at(now)
    outages.failed("gone", ConnectionRefusedError())
    now[0] = 6.0 + node_outages.FORGET_S  # its retry due longer than that: nothing asked it
    outages.failed("b", TimeoutError("no reply"))
    assert outages.names() == ["b"] and "gone" not in outages._until
    outages.failed("b", TimeoutError("no reply"))  # one still failing stays, and warned once
    assert list(outages._until) == ["b"] and outages._until["b"][1]


def test_a_reply_read_before_the_nodes_last_failure_does_not_bring_it_back():
    """Two round trips at once: one read the node's reply, then the node hung and the other
    failed on it and settled first. The older reply says nothing of the node now: it stays
    out; a reply read after the failure brings it back."""
    now = [10.0]
    outages = outages_at(now)
    outages.failed("a", TimeoutError("no reply"))  # noted at 10
    outages.answered("a", 9.5)  # read at 9.5, settled after the failure
    assert outages.names() == ["a"] and isinstance(outages.admit("a"), NodeOut)
    outages.answered("a", 10.5)  # read after it
    assert outages.names() == [] and outages.admit("a") is None
