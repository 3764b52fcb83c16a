"""scripts/chat_load.py against a stand-in completions server: every turn is sent after its
conversation's previous one answered, carries the history forward, and stays within the
concurrency; a failed turn is counted and the load goes on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.script_module import load_script

chat = load_script("chat_load")
SHAPE = chat.ChatShape(conversations=5, turns=4, opening=40, message=6, reply=3)


class StandIn:
    """Streams two chunks per completion after ``delay`` seconds; records each request's
    prompt (token ids) with its start and end, and answers 500 to prompts of ``fail_length``."""

    def __init__(self, delay: float = 0.02, fail_length: int | None = None) -> None:
        self.delay, self.fail_length = delay, fail_length
        self.seen: list[tuple[list[int], float, float]] = []
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                start = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = [int(word[1:]) for word in body["prompt"].split()]
                time.sleep(stand_in.delay)
                if len(prompt) == stand_in.fail_length:
                    self.send_response(500)
                    self.end_headers()
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for text in ("w1", " w2"):
                        self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                with stand_in.lock:
                    stand_in.seen.append((prompt, start, time.monotonic()))

        return Handler


@pytest.fixture
def server() -> Iterator[tuple[StandIn, str]]:
    stand_in = StandIn()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), stand_in.handler())
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield stand_in, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_each_turn_follows_its_conversations_last_answer_and_extends_its_history(server) -> None:
    stand_in, url = server
    result = chat.run_chat(url, SHAPE, concurrency=3, seed=7)
    assert result.failed == 0 and len(result.ttfts_s) == SHAPE.conversations * SHAPE.turns
    assert all(0 < t <= e for t, e in zip(result.ttfts_s, result.e2el_s, strict=True))
    openings = {}
    for prompt, start, end in sorted(stand_in.seen, key=lambda s: s[1]):
        opening = tuple(prompt[:SHAPE.opening])
        previous = openings.get(opening)
        if previous is None:
            assert len(prompt) == SHAPE.opening  # a conversation starts at its first turn
        else:
            last_prompt, _, last_end = previous
            assert start >= last_end - 1e-3  # sent once the turn before had answered
            assert prompt[:len(last_prompt)] == last_prompt  # the history so far, then more
            assert len(prompt) == len(last_prompt) + SHAPE.reply + SHAPE.message
        openings[opening] = (prompt, start, end)
    assert len(openings) == SHAPE.conversations
    assert max(len(p) for p, _, _ in stand_in.seen) == SHAPE.longest - SHAPE.reply


def test_no_more_turns_in_flight_than_the_concurrency(server) -> None:
    stand_in, url = server
    chat.run_chat(url, SHAPE, concurrency=2)
    edges = sorted([(s, 1) for _, s, _ in stand_in.seen] + [(e, -1) for _, _, e in stand_in.seen])
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
    stand_in.fail_length = SHAPE.opening + SHAPE.reply + SHAPE.message  # every second turn
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
