"""Requests as the hand-off tests give the scheduler side: block hashes of their own, and
``kv_transfer_params`` where a producer handed them off."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.helpers.scheduler_side import BLOCK, GEO

NS = GEO.namespace("m", "", 1, 0)
DIGEST = NS.digest().hex()


@dataclass
class Request:
    request_id: str
    num_tokens: int
    block_hashes: list = field(default_factory=list)
    kv_transfer_params: dict | None = None
    num_prompt_tokens: int | None = None  # None: the request does not say (no prompt tail)


def request(name: str, tokens: int, params=None, seed: int = 0,
            prompt: int | None = None) -> Request:
    return Request(name, tokens, [bytes([seed, i]) * 16 for i in range(tokens // BLOCK)],
                   params, prompt)
