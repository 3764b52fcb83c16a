"""Holders of a Mooncake store out of service alone (kvtier/remote/mooncake_holders.py),
against a stand-in client that answers replica lookups as Mooncake's does."""

from types import SimpleNamespace

from kvtier.io.result import IOResult, IOStatus
from kvtier.remote.mooncake_holders import Holders, holders_of

OK, FAIL = IOResult(IOStatus.OK, 8), IOResult(IOStatus.IO_ERROR, 0, "get: TRANSFER_FAIL (-800)")


def replica(endpoint: str, memory: bool = True):
    buffer = SimpleNamespace(transport_endpoint=endpoint)
    return SimpleNamespace(is_memory_replica=lambda: memory,
                           get_memory_descriptor=lambda: SimpleNamespace(buffer_descriptor=buffer))


class Client:
    """Values ``held[name]`` (their holders' endpoints); holders in ``dead`` fail transfers."""

    def __init__(self, held: dict[str, list[str]]) -> None:
        self.held, self.dead, self.lookups = held, set(), 0

    def batch_get_replica_desc(self, names):
        self.lookups += 1
        return {name: [replica(h) for h in self.held[name]] for name in names if name in self.held}

    def read(self, names, answered=True):
        def run(at):
            return [FAIL if set(self.held.get(names[i], [])) <= self.dead else OK for i in at], answered
        return run


def make(now):
    return Holders(5.0, "mooncake://test", clock=lambda: now[0])


def test_no_lookup_while_no_holder_is_out():
    client, holders = Client({"a": ["h1"], "b": ["h2"]}), make([0.0])
    results, unblamed = holders.read(client, ["a", "b"], client.read(["a", "b"]))
    assert [r.ok for r in results] == [True, True] and unblamed is None and client.lookups == 0


def test_a_dead_holders_keys_are_answered_unread_until_its_trial_and_it_comes_back():
    now, names = [0.0], ["a", "b", "c"]
    client, holders = Client({"a": ["h1"], "b": ["h2"], "c": ["h2"]}), make(now)
    client.dead = {"h2"}
    results, unblamed = holders.read(client, names, client.read(names))
    assert [r.status for r in results] == [IOStatus.OK, IOStatus.IO_ERROR, IOStatus.IO_ERROR]
    assert unblamed is None and holders.outages.names() == ["h2"]
    asked: list[list[int]] = []

    def reading(at):
        asked.append(list(at))
        return client.read(names)(at)

    results, _ = holders.read(client, names, reading)
    assert asked == [[0]] and [r.status for r in results[1:]] == [IOStatus.PATH_DOWN] * 2
    assert "holder h2 out of service" in results[1].detail
    now[0] = 6.0  # past retry_s: the trial reads both of its keys, and it answers
    client.dead = set()
    results, _ = holders.read(client, names, reading)
    assert asked[-1] == [0, 1, 2] and all(r.ok for r in results) and holders.outages.names() == []


def test_a_failure_laid_on_no_holder_is_the_tiers():
    client, holders = Client({"a": ["h1"]}), make([0.0])
    results, unblamed = holders.read(client, ["a", "gone"], client.read(["a", "gone"]))
    assert results[1].status is IOStatus.IO_ERROR and unblamed is results[1]
    assert holders.outages.names() == []


def test_nothing_is_blamed_when_the_master_did_not_answer():
    client, holders = Client({"a": ["h1"]}), make([0.0])
    client.dead = {"h1"}
    _, unblamed = holders.read(client, ["a"], client.read(["a"], answered=False))
    assert unblamed is None and holders.outages.names() == [] and client.lookups == 0


def test_a_key_with_a_replica_on_a_holder_in_service_is_still_read():
    now, names = [0.0], ["a", "b"]
    client, holders = Client({"a": ["h1"], "b": ["h1", "h2"]}), make(now)
    client.dead = {"h1"}
    holders.read(client, ["a"], client.read(["a"]))
    assert holders.outages.names() == ["h1"]
    asked: list[list[int]] = []
    holders.read(client, names, lambda at: (asked.append(list(at)), client.read(names)(at))[1])
    assert asked == [[1]]


def test_holders_of_reads_memory_replicas_and_survives_a_refusing_client():
    client = Client({"a": ["h1", "h2"]})
    assert holders_of(client, ["a", "b"]) == [frozenset({"h1", "h2"}), frozenset()]

    class Refusing:
        def batch_get_replica_desc(self, names):
            raise RuntimeError("no")

    assert holders_of(Refusing(), ["a"]) == [frozenset()]
    disk = SimpleNamespace(batch_get_replica_desc=lambda names: {"a": [replica("h9", memory=False)]})
    assert holders_of(disk, ["a"]) == [frozenset()]


def test_a_holder_no_key_names_any_more_costs_no_lookup_after_its_retry():
    """The master dropped a dead holder's segment: no get asks for its keys again, and
    gets stop asking the master for holders once ``retry_s`` past its outage passed."""
    now, client, holders = [0.0], Client({"a": ["h1"], "b": ["h2"]}), make([0.0])
    holders = make(now)
    client.dead = {"h2"}
    holders.read(client, ["b"], client.read(["b"]))
    del client.held["b"]
    now[0] = 4.0
    holders.read(client, ["a"], client.read(["a"]))
    asked = client.lookups
    now[0] = 11.0  # past its outage (5 s) and retry_s more
    holders.read(client, ["a"], client.read(["a"]))
    assert client.lookups == asked


def test_an_answer_read_before_a_holders_failure_does_not_bring_it_back():
    now, client, holders = [0.0], Client({"a": ["h1"], "b": ["h1"]}), make([0.0])
    holders = make(now)

    def slow(at):  # another get fails h1 while this one's read of it is under way
        now[0] = 1.0
        client.dead = {"h1"}
        holders.read(client, ["b"], client.read(["b"]))
        return [OK], True

    now[0] = 0.5
    holders.outages.failed("h0", ConnectionError("x"))  # some holder out: lookups made
    holders.read(client, ["a"], slow)
    assert "h1" in holders.outages.names()


def test_a_key_on_several_holders_neither_blames_nor_clears_them():
    client, holders = Client({"a": ["h1", "h2"], "b": ["h1"]}), make([0.0])
    client.dead = {"h1", "h2"}
    results, unblamed = holders.read(client, ["a"], client.read(["a"]))
    assert results[0].status is IOStatus.IO_ERROR and unblamed is None
    assert holders.outages.names() == []
    holders.read(client, ["b"], client.read(["b"]))
    assert holders.outages.names() == ["h1"]
    client.dead = {"h1"}  # a is served by h2: h1 stays out
    holders.read(client, ["a"], client.read(["a"]))
    assert holders.outages.names() == ["h1"]


def test_a_failure_other_than_a_transfers_is_the_tiers():
    client, holders = Client({"a": ["h1"]}), make([0.0])
    other = IOResult(IOStatus.IO_ERROR, 0, "get: INTERNAL_ERROR (-1)")
    _, unblamed = holders.read(client, ["a"], lambda at: ([other], True))
    assert unblamed is other and holders.outages.names() == []


def test_a_lookup_says_a_key_held_only_on_holders_out_is_no_answer():
    client, holders = Client({"a": ["h1"], "b": ["h2"], "c": ["h1", "h2"]}), make([0.0])
    holders.outages.failed("h1", ConnectionError("x"))
    found = holders_of(client, ["a", "b", "c", "d"])
    assert holders.servable([True, True, True, False], found) == [None, True, True, False]
    assert holders.servable([True], None) == [True]
