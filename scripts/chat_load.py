"""A multi-turn chat load on an OpenAI completions endpoint (an engine or a router): each
conversation opens with a long first message (a document, a long system prompt) and goes on
turn by turn, every turn's prompt the whole history so far (earlier prompts and replies) and
a new message. A turn is sent only once its conversation's previous turn has answered, and
at most ``concurrency`` turns are in flight.

The prompts are token ids, or text of one word per token (word ``w{i}`` is token i: scripts/bench_router.py's
word-level tokenizer), drawn from ``seed``; so are the replies that enter the history, so every
arm of a benchmark sends the same prompts in the same order, whatever the model answered.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tests.helpers.router_fleet import complete

VOCAB = (100, 30000)  # token ids drawn: clear of the tokenizer's specials at the start


@dataclass(frozen=True)
class ChatShape:
    """``conversations`` of ``turns`` turns: the first message ``opening`` tokens, each later
    one ``message`` tokens, each reply ``reply`` tokens (the completion's ``max_tokens``)."""

    conversations: int
    turns: int
    opening: int
    message: int
    reply: int

    @property
    def longest(self) -> int:
        """Tokens of the last turn's prompt and its reply."""
        return self.opening + (self.turns - 1) * (self.reply + self.message) + self.reply


@dataclass
class ChatResult:
    ttfts_s: list[float] = field(default_factory=list)  # every answered turn, in answer order
    e2el_s: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures' messages
    duration: float = 0.0


def histories(shape: ChatShape, seed: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn (token ids): a turn's prompt is the one before,
    that turn's reply and a new message."""
    rng = np.random.default_rng(seed)

    def words(count: int) -> list[int]:
        return rng.integers(*VOCAB, size=count).tolist()

    out = []
    for _ in range(shape.conversations):
        prompts = [words(shape.opening)]
        for _ in range(shape.turns - 1):
            prompts.append(prompts[-1] + words(shape.reply) + words(shape.message))
        out.append(prompts)
    return out


def order(shape: ChatShape, seed: int) -> list[int]:
    """The conversations in the order their turns are offered: each ``turns`` times, shuffled."""
    rng = np.random.default_rng(seed + 1)
    return rng.permutation(np.repeat(np.arange(shape.conversations), shape.turns)).tolist()


class Dispatcher:
    """Hands out turns in ``order``, skipping a conversation whose previous turn is in flight
    (it is taken up again at the next free slot): ``take`` blocks until a turn is ready and
    returns (conversation, turn) or None when none is left; ``done`` frees a conversation."""

    def __init__(self, offered: list[int]) -> None:
        self._left, self._busy, self._next = list(offered), set(), {}
        self._ready = threading.Condition()

    def take(self) -> tuple[int, int] | None:
        with self._ready:
            while True:
                if not self._left:
                    return None
                pick = next((i for i, c in enumerate(self._left) if c not in self._busy), None)
                if pick is not None:
                    conversation = self._left.pop(pick)
                    self._busy.add(conversation)
                    turn = self._next.get(conversation, 0)
                    self._next[conversation] = turn + 1
                    return conversation, turn
                self._ready.wait()

    def done(self, conversation: int) -> None:
        with self._ready:
            self._busy.discard(conversation)
            self._ready.notify_all()


def run_chat(url: str, shape: ChatShape, concurrency: int, seed: int = 0,
             timeout: float = 120.0, token_ids: bool = False, sessions: bool = False) -> ChatResult:
    """The whole load against ``url``, prompts as text (or as token ids with ``token_ids``),
    each turn naming its conversation (``X-Session-ID: chat-<n>``) with ``sessions``; a failed
    turn is counted (its message kept) and its conversation goes on."""
    prompts, result = histories(shape, seed), ChatResult()
    dispatcher, lock = Dispatcher(order(shape, seed)), threading.Lock()

    def worker() -> None:
        while (taken := dispatcher.take()) is not None:
            conversation, turn = taken
            ids = prompts[conversation][turn]
            prompt = ids if token_ids else " ".join(f"w{t}" for t in ids)
            try:
                reply = complete(url, prompt, max_tokens=shape.reply, timeout=timeout,
                                 session=f"chat-{conversation}" if sessions else None)
            except Exception as error:  # a failed turn is counted, not fatal
                with lock:
                    result.failed += 1
                    if len(result.errors) < 5:
                        result.errors.append(f"{type(error).__name__}: {error}")
            else:
                with lock:
                    result.ttfts_s.append(reply.ttft)
                    result.e2el_s.append(reply.seconds)
            finally:
                dispatcher.done(conversation)

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        for running in [pool.submit(worker) for _ in range(concurrency)]:
            running.result()
    result.duration = time.monotonic() - start
    return result
