"""Which chunks of a request the remote store holds, as the scheduler side asks it: one
round trip per request and rank (every rank's copy must be there), on threads of its own;
a scheduler step waits on the store at most ``INLINE_WAIT_S`` in all."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from kvtier.config.settings import KVTierConfig
from kvtier.connector.scheduler.remote_distrust import DistrustedKeys
from kvtier.io.guarded import started_pool
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.opening import open_remote

log = logging.getLogger("kvtier")
# how long one scheduler step may wait, in all, for the answers to the questions it sends: a
# round trip on a LAN is well inside it, and a request asked to come back waits a whole step
INLINE_WAIT_S = 0.002
# questions sent and not over, at most: past that a new question waits to be sent
MAX_QUESTIONS = 128
# keys the store answered "not there" and the scheduler has not taken yet, at most
ABSENT_MAX = 4096


@dataclass
class _Question:
    """What was asked of the store about one request, and what its loads taught."""

    keys: tuple[ChunkKey, ...]
    since: float  # when the request first asked about these keys
    answer: Future[list[bool]] | None = None  # None: not sent yet (too many out)
    refused: set[ChunkKey] = field(default_factory=set)  # failed to load for this request


class RemotePresence:
    """Contract: ``held(req_id, keys)`` returns, for each of ``keys`` (a request's chunk
    keys), whether every rank's copy is in the store, once known; None while the question
    runs (the caller asks again next step). The first call about a request sends the
    question, to run in the background; the answer is kept until ``forget(req_id)`` (which
    cancels a question not yet run), and asked again when the keys grow or change (a
    request's tail key gives way to its full chunk's). While the store is out of service
    the answer is "none" at once. A question not answered within ``wait_s`` of the
    request's first call counts as "none".

    A scheduler step waits on the store at most ``INLINE_WAIT_S`` in all: a call that sends
    a question waits for its answer out of what the step has left, which ``next_step()``
    (once per scheduler step) renews. At most ``max_questions`` are out (sent, not answered)
    at once; past that a request's question waits (None: ask again) to be sent.

    ``failed(req_id, keys, damaged)``: a load of ``keys`` from the store failed: they are
    not held for that request from then on, nor for any request while distrusted
    (``DistrustedKeys``): those ``damaged`` (a value evicted since the lookup, or one that
    failed its checks: the store still says it holds it) for ``DISTRUST_S``, the others (a
    timeout, the workers' store out of service) for ``retry_s``, the workers' wait before
    they try the store again. ``close()`` stops the threads and the tiers.

    ``take_absent()``: the keys the store answered "not there" (every tier's round trip
    answered, so the store's word: a chunk a restart or an eviction lost) since the last
    call, at most ``ABSENT_MAX`` (the newest), for the writes to forget they stored them."""

    def __init__(self, tiers: Sequence[RemoteTier], wait_s: float,
                 max_questions: int = MAX_QUESTIONS,
                 distrusted: DistrustedKeys | None = None, retry_s: float = 10.0) -> None:
        self.tiers, self._wait_s, self._max_questions = list(tiers), wait_s, max_questions
        self._retry_s = retry_s
        self._pool = started_pool(2, "kvtier-remote-lookup")  # none to start later, in a step
        self._asked: dict[str, _Question] = {}  # req id -> its question
        self._distrusted = DistrustedKeys() if distrusted is None else distrusted
        self._out = 0  # questions sent and not over (answered, or cancelled unsent)
        self._out_lock = threading.Lock()
        self._wait_left = INLINE_WAIT_S  # what this step may still wait inline
        self._closed = False
        self.lookups = 0  # questions sent
        self._absent: deque[ChunkKey] = deque(maxlen=ABSENT_MAX)  # appended on the threads
        self.on_gone: Callable[[list[ChunkKey]], None] | None = None  # the KV events' (``gone``)

    @property
    def down(self) -> bool:
        return any(tier.down for tier in self.tiers)

    @property
    def out_of_service(self) -> bool:
        """Some tier out until a round trip works (``RemoteTier.out_of_service``)."""
        return any(tier.out_of_service for tier in self.tiers)

    def nodes_out(self) -> int:
        """The store's nodes out of service alone now (a cluster's), as any rank's copy
        found them."""
        return len(set().union(*(tier.nodes_out() for tier in self.tiers)))

    @property
    def questions_out(self) -> int:
        """Questions sent and not answered yet."""
        return self._out

    def held(self, req_id: str, keys: Sequence[ChunkKey]) -> list[bool] | None:
        question = self._question(req_id, keys)
        if question is None:
            return [False] * len(keys)
        found = self._answer(question)
        if found is None:
            return None
        found = (found + [False] * len(keys))[:len(keys)]
        return [there and key not in question.refused and key not in self._distrusted
                for key, there in zip(keys, found, strict=True)]

    def _question(self, req_id: str, keys: Sequence[ChunkKey]) -> _Question | None:
        """The request's question about ``keys``, sent when there is room; None (the
        answer is "none") while the store is out of service."""
        question = self._asked.get(req_id)
        if question is None or question.keys[:len(keys)] != tuple(keys):  # more keys, or others
            if self.down or self._closed:
                return None
            refused: set[ChunkKey] = set()
            if question is not None:
                refused = question.refused
                self._cancel(question)
            question = _Question(tuple(keys), time.monotonic(), refused=refused)
            self._asked[req_id] = question
        if question.answer is None:
            if self.down or self._closed:
                return None
            self._send(question)
        return question

    def _send(self, question: _Question) -> None:
        """Send ``question`` unless ``max_questions`` are out; wait for its answer out of
        what the step has left to wait."""
        with self._out_lock:
            if self._out >= self._max_questions:
                return
            self._out += 1
        self.lookups += 1
        answer = self._pool.submit(self._ask, list(question.keys))
        answer.add_done_callback(self._over)
        question.answer = answer
        if self._wait_left > 0:
            start = time.monotonic()
            wait_futures([answer], timeout=self._wait_left)
            self._wait_left -= time.monotonic() - start

    def _answer(self, question: _Question) -> list[bool] | None:
        """The store's answer (one per key asked), "none" once ``wait_s`` passed since the
        question was first made, None until then."""
        answer = question.answer
        if answer is None or not answer.done():
            if time.monotonic() - question.since < self._wait_s:
                return None
            if answer is None:  # never sent: it is never sent now
                question.answer = answer = Future()
                answer.set_result([False] * len(question.keys))
            answer.cancel()  # when still queued
            return [False] * len(question.keys)
        if answer.cancelled():
            return [False] * len(question.keys)
        try:
            return answer.result()
        except Exception as exc:  # a bug, not a store fault (those are results): a miss
            log.warning("kvtier: remote lookup failed: %r", exc)
            return [False] * len(question.keys)

    def _ask(self, keys: list[ChunkKey]) -> list[bool]:
        answer = self._held_now(keys)
        return [False] * len(keys) if answer is None else answer

    def _held_now(self, keys: list[ChunkKey]) -> list[bool] | None:
        """Whether every rank's copy of each key is in the store (None: a round trip failed,
        nothing known)."""
        answers = self._answers(keys)
        return None if answers is None else answers[0]

    def _answers(self, keys: list[ChunkKey]) -> tuple[list[bool], list[bool]] | None:
        """(whether every rank's copy of each key is in the store, whether some rank's
        store answered it is not): None when a round trip failed. A key answered "not
        there" goes to ``take_absent``; one a store refused to answer for (a cluster's
        redirect) is neither held nor lost."""
        found, absent = [True] * len(keys), [False] * len(keys)
        for tier in self.tiers:  # every rank's copy
            answer = tier.exists_answered(keys)
            if answer is None:
                return None
            found = [f and a is True for f, a in zip(found, answer, strict=True)]
            absent = [g or a is False for g, a in zip(absent, answer, strict=True)]
        self._absent.extend(key for key, gone in zip(keys, absent, strict=True) if gone)
        return found, absent

    def audit(self, keys: Sequence[ChunkKey]) -> Future[list[bool] | None]:
        """Ask about ``keys`` in the background for no request (``RemoteAudit``): their
        "not there" answers reach ``take_absent``. The answer is, per key, False where a
        store answered "not there" (lost), or None when a round trip failed (nothing
        known)."""
        return self._pool.submit(self._audit, list(keys))

    def _audit(self, keys: list[ChunkKey]) -> list[bool] | None:
        answers = self._answers(keys)  # a key refused an answer is not lost
        return None if answers is None else [not gone for gone in answers[1]]

    def take_absent(self) -> list[ChunkKey]:
        taken: list[ChunkKey] = []
        for _ in range(len(self._absent)):
            try:
                taken.append(self._absent.popleft())
            except IndexError:  # a clear meanwhile: none left
                break
        return taken

    def _over(self, answer: Future[list[bool]]) -> None:
        with self._out_lock:
            self._out -= 1

    @staticmethod
    def _cancel(question: _Question) -> None:
        if question.answer is not None:
            question.answer.cancel()  # a question still queued is never sent

    def next_step(self) -> None:
        """A new scheduler step: its inline waits start from ``INLINE_WAIT_S`` again."""
        self._wait_left = INLINE_WAIT_S

    def failed(self, req_id: str, keys: Iterable[ChunkKey],
               damaged: Iterable[ChunkKey] = ()) -> None:
        """Loading ``keys`` of ``req_id`` from the store failed; ``damaged`` were read and
        are not there as stored (missing, or failing their checks)."""
        failed, damaged = set(keys), set(damaged)
        question = self._asked.get(req_id)
        if question is not None:
            question.refused |= failed
        self._distrusted.add(failed & damaged)
        self._distrusted.add(failed - damaged, self._retry_s)

    def gone(self, keys: Iterable[ChunkKey]) -> None:
        """The store is known not to hold ``keys`` any more (a read of them answered missing
        or damaged, or they were removed as wrong): told to ``on_gone`` at once (the KV
        events, which publish their removal), on the scheduler's thread."""
        keys = list(keys)
        if keys and self.on_gone is not None:
            self.on_gone(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` hold wrong KV (a check against a recompute): removed from the store, every
        rank's copy, in the background; not offered to any request meanwhile (``gone``)."""
        self._distrusted.add(set(keys))
        self.gone(keys)
        if not self._closed:
            self._pool.submit(lambda: [tier.remove(list(keys)) for tier in self.tiers])

    def log(self, records: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Append chunks' token records to the store's log of them (rank 0's namespace), in
        the background; nothing where the store keeps none. A failed round trip loses
        them: the log is a hint to other engines' KV events, never a promise."""
        tier = self.tiers[0]
        if tier.keeps_records and not self._closed:
            self._pool.submit(tier.append_records, list(records))

    def forget(self, req_id: str) -> None:
        question = self._asked.pop(req_id, None)
        if question is not None:
            self._cancel(question)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()


def open_presence(config: KVTierConfig, namespaces: Sequence[Namespace],
                  raw_bytes: int) -> RemotePresence | None:
    """The scheduler side's questions to the remote store (None without ``remote_url``)."""
    tiers = [open_remote(config, ns, raw_bytes) for ns in namespaces]
    if not tiers or tiers[0] is None:
        return None
    return RemotePresence([t for t in tiers if t is not None], 2 * config.remote_timeout,
                          retry_s=config.remote_retry)
