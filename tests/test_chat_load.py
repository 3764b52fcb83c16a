"""scripts/chat_load.py against a stand-in completions server: every turn is sent after its
conversation's previous one answered, carries the history forward, and stays within the
concurrency; a failed turn is counted and the load goes on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers.script_module import load_script
from tests.helpers.stand_in_engine import Seen, StandInEngine

chat = load_script("chat_load")
SHAPE = chat.ChatShape(conversations=5, turns=4, opening=40, message=6, reply=3)


def prompt(seen: Seen) -> list[int]:
    return [int(word[1:]) for word in seen.body["prompt"].split()]


@pytest.fixture
def server() -> Iterator[tuple[StandInEngine, str]]:
    engine = StandInEngine(delay=0.02)
    yield engine, engine.url
    engine.close()


def test_each_turn_follows_its_conversations_last_answer_and_extends_its_history(server) -> None:
    stand_in, url = server
    result = chat.run_chat(url, SHAPE, concurrency=3, seed=7)
    assert result.failed == 0 and len(result.ttfts_s) == SHAPE.conversations * SHAPE.turns
    assert all(0 < t <= e for t, e in zip(result.ttfts_s, result.e2el_s, strict=True))
    openings = {}
    for seen in sorted(stand_in.seen, key=lambda s: s.start):
        ids, start, end = prompt(seen), seen.start, seen.end
        opening = tuple(ids[:SHAPE.opening])
        previous = openings.get(opening)
        if previous is None:
            assert len(ids) == SHAPE.opening  # a conversation starts at its first turn
        else:
            last_ids, last_end = previous
            assert start >= last_end - 1e-3  # sent once the turn before had answered
            assert ids[:len(last_ids)] == last_ids  # the history so far, then more
            assert len(ids) == len(last_ids) + SHAPE.reply + SHAPE.message
        openings[opening] = (ids, end)
    assert len(openings) == SHAPE.conversations
    assert max(len(prompt(s)) for s in stand_in.seen) == SHAPE.longest - SHAPE.reply


def test_with_sessions_every_turn_names_its_conversation_and_only_then(server) -> None:
    stand_in, url = server
    chat.run_chat(url, SHAPE, concurrency=3, sessions=True)
    by_opening: dict[tuple[int, ...], set[str | None]] = {}
    for seen in stand_in.seen:
        by_opening.setdefault(tuple(prompt(seen)[:SHAPE.opening]), set()).add(seen.session)
    named = [sessions.pop() for sessions in by_opening.values() if len(sessions) == 1]
    assert len(named) == SHAPE.conversations == len(set(named)) and None not in named
    stand_in.seen.clear()
    chat.run_chat(url, SHAPE, concurrency=3)
    assert {seen.session for seen in stand_in.seen} == {None}


def test_no_more_turns_in_flight_than_the_concurrency(server) -> None:
    stand_in, url = server
    chat.run_chat(url, SHAPE, concurrency=2)
    edges = sorted([(s.start, 1) for s in stand_in.seen] + [(s.end, -1) for s in stand_in.seen])
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2


def test_every_arm_sends_the_same_prompts_in_the_same_order() -> None:
    assert chat.histories(SHAPE, 3) == chat.histories(SHAPE, 3)
    assert chat.order(SHAPE, 3) == chat.order(SHAPE, 3)
    assert sorted(chat.order(SHAPE, 3)) == sorted(list(range(SHAPE.conversations)) * SHAPE.turns)
    assert chat.histories(SHAPE, 3) != chat.histories(SHAPE, 4)


def test_a_failed_turn_is_counted_with_its_message_and_the_load_goes_on(server) -> None:
    stand_in, url = server
    second = SHAPE.opening + SHAPE.reply + SHAPE.message
    stand_in.fail = lambda body: len(body["prompt"].split()) == second  # every second turn
    result = chat.run_chat(url, SHAPE, concurrency=2)
    assert result.failed == SHAPE.conversations
    assert len(result.ttfts_s) == SHAPE.conversations * (SHAPE.turns - 1)
    assert "HTTP 500" in result.errors[0]


def test_a_turn_whose_conversation_is_in_flight_waits_and_the_next_one_goes_first() -> None:
    dispatcher = chat.Dispatcher([0, 0, 1])
    assert dispatcher.take() == (0, 0)
    assert dispatcher.take() == (1, 0)  # conversation 0 is in flight: its second turn waits
    later: list = []
    waiting = threading.Thread(target=lambda: later.append(dispatcher.take()))
    waiting.start()
    time.sleep(0.05)
    assert later == []
    dispatcher.done(0)
    waiting.join(timeout=5)
    assert later == [(0, 1)]
    dispatcher.done(1)
    dispatcher.done(0)
    assert dispatcher.take() is None
