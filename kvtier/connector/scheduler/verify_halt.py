"""When sampled checks keep finding wrong chunks, hits stop (``verify_halt_after``).

One wrong chunk is removed and the engine goes on. Several mean something is writing wrong
KV under right keys (a co-writer with another layout, a copy bug): every other chunk from
the same source is suspect, so the engine serves no more hits, computes every prompt, and
says so once. The halt lasts until the engine restarts; an operator first checks the cache
and removes what is wrong (``kvtier verify --repair``, or ``kvtier clear``).
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("kvtier")


class VerifyHalt:
    """Counts mismatches; ``halted`` once ``limit`` of them were found (never with 0)."""

    def __init__(self, limit: int, counters: Counter) -> None:
        self.limit, self.counters = limit, counters
        self.mismatches = 0
        self.halted = False

    def mismatch(self) -> None:
        self.mismatches += 1
        if self.halted or not self.limit or self.mismatches < self.limit:
            return
        self.halted = True
        self.counters["verify_halted"] = 1
        log.error("kvtier: %d cached chunks held KV other than what vLLM computed for their "
                  "tokens (verify_halt_after=%d): this engine serves no more hits and computes "
                  "every prompt until it restarts; first check the cache with `kvtier verify "
                  "--repair` (or empty it with `kvtier clear`), and look for a writer of "
                  "another model, layout or version on it", self.mismatches, self.limit)
