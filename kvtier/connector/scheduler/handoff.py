"""A prefill/decode split through the pool: vLLM's ``kv_role`` on the scheduler side.

A producer (``kv_producer``) computes prompts and stores them as every engine does (full
chunks and the prompt's tail, written through to the pool it shares: a shared directory's
segment, the remote store); when a request finishes it hands vLLM ``kv_transfer_params``
saying what it stored (``Handoff``): the prompt's length and the namespace. A router passes
them on with the request to a consumer (``kv_consumer``), which loads from the pool and
stores nothing. The producer's writes reach the pool in the background, so the consumer
may see the request before they land: it then waits, asking again each step (``None``:
vLLM schedules the request later), for the handed-off tokens to be all visible, at most
``load_timeout``; past that it loads what it found and recomputes the rest, counted
(``handoffs_incomplete``) and said once. ``kv_both`` (the default) stores and loads, and
waits as a consumer does for a request that comes with a hand-off."""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.config.settings import KVTierConfig, WritePolicy
from kvtier.connector.scheduler.pool_reach import shares_directory
from kvtier.keys import Namespace

log = logging.getLogger("kvtier")
PARAMS_KEY = "kvtier"  # kvtier's entry in kv_transfer_params
ASK_EVERY_S = 0.02  # a waiting request asks the pool again at most this often
WAIT_S_WITHOUT_LOAD_TIMEOUT = 30.0  # the wait for a hand-off with load_timeout off
MAX_WAITING = 4096  # requests waiting for handed-off KV at once; more load what is there
EPOCH_BYTES = 16  # a cache reset's epoch (``Handoffs.reset``)


class Role(enum.Enum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @classmethod
    def of(cls, kv_role: str | None) -> Role:
        """vLLM's ``kv_role`` (None: ``kv_both``); a role vLLM does not define is refused."""
        if kv_role is None:
            return cls.BOTH
        try:
            return cls(kv_role)
        except ValueError:
            raise ValueError(f"kv_role {kv_role!r}: kvtier takes kv_producer, kv_consumer or "
                             "kv_both") from None


@dataclass(frozen=True)
class Handoff:
    """What a producer stored of a request: its prompt's first ``tokens`` tokens, under
    ``namespace`` (a digest, hex: the same model, layout and chunking as the consumer's),
    keyed in ``epoch`` (hex: the producer's since its last cache reset, ``Handoffs.epoch``;
    empty before any)."""

    tokens: int
    namespace: str
    epoch: str = ""

    def params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"tokens": self.tokens, "namespace": self.namespace,
                             **({"epoch": self.epoch} if self.epoch else {})}}

    @classmethod
    def of(cls, params: Any) -> Handoff | None:
        """The hand-off in a request's ``kv_transfer_params`` (from a client: anything at
        all), or None when there is none or it does not read as one."""
        entry = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if not isinstance(entry, dict):
            return None
        tokens, namespace, epoch = entry.get("tokens"), entry.get("namespace"), entry.get("epoch", "")
        if type(tokens) is not int or tokens < 0 or not isinstance(namespace, str) \
                or len(namespace) > 128 or not isinstance(epoch, str) or not _is_epoch(epoch):
            return None
        return cls(tokens, namespace, epoch)


def _is_epoch(text: str) -> bool:
    """An epoch as ``Handoffs.reset`` makes them (hex, ``EPOCH_BYTES``), or none."""
    return text == "" or (len(text) == 2 * EPOCH_BYTES and all(c in "0123456789abcdef" for c in text))


class Handoffs:
    """Contract: ``stores`` says whether this engine stores what it computes (not a
    consumer). ``params(request, stored)`` is what a finishing request hands vLLM: a
    producer's ``Handoff`` of the prompt's first ``stored`` tokens (those whose chunks it
    offered to the pool: a consumer waits for no more; the whole prompt when None), None
    otherwise. ``match(request, found, visible, end, num_computed, ask_again)`` takes what
    the tiers matched for a request (tokens past ``num_computed`` to load, or None: ask
    again; ``visible``: those found cached, before a cut that waiting cannot change: the
    load policy, host memory's room; ``end``: the furthest token stored chunks can reach)
    and returns it, or None while the handed-off tokens up to ``end`` are not all visible
    and its wait (``timeout_s`` from the first ask; 30 s when None) is not over (never
    without a pool shared with other engines: ``pooled``, ``has_pool``); once it is
    (met or run out) every later ask of the request (a preemption asks again) is answered at
    once. ``ask_again(req_id)`` is called, at most every
    ``ASK_EVERY_S``, for the pool to be looked at anew. ``forget(req_id)`` when the request
    is over. ``epoch``: what every key this engine makes adds (b"" until ``reset``: vLLM's
    cache reset, new weights in place: a random one, so that no chunk stored before, here
    or by any engine, matches a key made since); ``epoch_of(request)`` the one a request is
    keyed in: on a consumer, that of the hand-off it carries (its producer's, whose weights
    a prefill/decode split trusts as its own; a consumer stores nothing), else ``epoch``."""

    def __init__(self, role: Role, namespace: Namespace, timeout_s: float | None,
                 counters: Counter, pooled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self._digest, self._pooled = role, namespace.digest().hex(), pooled
        self._timeout_s = WAIT_S_WITHOUT_LOAD_TIMEOUT if timeout_s is None else timeout_s
        self._counters, self._clock = counters, clock
        self._since: dict[str, tuple[float, float]] = {}  # req id -> (first ask, last ask)
        self._said: set[str] = set()  # what was logged once
        self._over: set[str] = set()  # requests whose wait is over, met or run out: no other
        self.epoch = b""

    def reset(self) -> None:
        self.epoch = secrets.token_bytes(EPOCH_BYTES)

    def epoch_of(self, request: Any) -> bytes:
        handoff = Handoff.of(getattr(request, "kv_transfer_params", None))
        if self.role is Role.CONSUMER and handoff is not None and handoff.namespace == self._digest:
            return bytes.fromhex(handoff.epoch)
        return self.epoch

    @property
    def stores(self) -> bool:
        return self.role is not Role.CONSUMER

    def params(self, request: Any, stored: int | None = None,
               epoch: bytes | None = None) -> dict[str, Any] | None:
        """(``epoch``: the request's keys', this engine's now when None)"""
        if self.role is not Role.PRODUCER:
            return None
        length = getattr(request, "num_prompt_tokens", None)
        if not isinstance(length, int):
            return None
        return Handoff(length if stored is None else min(length, stored), self._digest,
                       (self.epoch if epoch is None else epoch).hex()).params()

    def match(self, request: Any, found: int | None, visible: int | None, end: int,
              num_computed: int, ask_again: Callable[[str], None]) -> int | None:
        handoff = Handoff.of(getattr(request, "kv_transfer_params", None))
        if handoff is None or found is None or visible is None or self.role is Role.PRODUCER \
                or not self._pooled:  # (a producer computes its prompts: it waits for no one's;
            return found  # an engine sharing no pool would wait for nothing that can come)
        req_id = request.request_id
        if req_id in self._over:  # asked again (preempted, or not scheduled): what the pool
            return found  # holds, at once: the producer wrote what it had long ago
        if req_id not in self._since and len(self._since) >= MAX_WAITING:
            self._say("waiting", f"more than {MAX_WAITING} requests wait for handed-off KV: "
                      "the others load what the pool holds now (params any client can send)")
            self._over.add(req_id)
            return found
        if handoff.namespace != self._digest:
            self._say("namespace", "a request handed off by an engine of another model, "
                      "layout or chunking: not waited for (loads what matches)")
            return found
        wanted = min(handoff.tokens - 1, end) - num_computed
        if visible >= wanted:
            self._end(req_id)
            return found
        now = self._clock()
        first, last = self._since.setdefault(req_id, (now, 0.0))
        if now - first < self._timeout_s:
            if now - last >= ASK_EVERY_S:
                self._since[req_id] = (first, now)
                ask_again(req_id)
            return None
        self._end(req_id)
        self._counters["handoffs_incomplete"] += 1
        # vLLM's own hits may reach past the pool's whole chunks: it recomputes what is past them
        self._counters["handoff_tokens_recomputed"] += wanted - max(visible, 0)
        self._say("incomplete", f"a handed-off prompt was not all in the pool after "
                  f"{self._timeout_s:g} s (load_timeout): its missing tokens are recomputed "
                  "(the producer died, or its writes failed or are slow; counted in "
                  "kvtier_handoffs_incomplete_total)")
        return found

    def _end(self, req_id: str) -> None:
        self._over.add(req_id)
        if self._since.pop(req_id, None) is not None:
            self._counters["handoffs_waited"] += 1

    def _say(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning("kvtier: %s", text)

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._over.discard(req_id)


def fit_role(role: Role, config: KVTierConfig) -> KVTierConfig:
    """``config`` as ``role`` needs it, said once at start: a producer writes every chunk
    to the pool as soon as it has it (``write_policy`` write_through, ``remote_min_hits``
    0: a chunk kept in host memory, or written to the store only after some hits, would
    never reach a consumer); a producer or consumer that shares no pool (no directory
    other engines follow, no ``remote_url``) can hand nothing off."""
    if role is Role.PRODUCER and (config.write_policy is not WritePolicy.WRITE_THROUGH
                                  or config.remote_min_hits):
        log.warning("kvtier: kv_producer writes every chunk to the pool at once: write_policy "
                    "write_through and remote_min_hits 0 (in place of %s and %d)",
                    config.write_policy.value, config.remote_min_hits)
        config = dataclasses.replace(config, write_policy=WritePolicy.WRITE_THROUGH,
                                     remote_min_hits=0)
    if role is not Role.BOTH and not has_pool(config):
        log.warning("kvtier: kv_role %s but no pool shared with other engines: set disk_paths "
                    "on a directory they share (with share_writers above 1), or remote_url; "
                    "until then nothing is handed off (a consumer waits for nothing)", role.value)
    return config


def has_pool(config: KVTierConfig) -> bool:
    """Whether this engine shares a pool with other engines: a directory they follow, or a
    remote store."""
    return bool(config.remote_url) or shares_directory(config)
