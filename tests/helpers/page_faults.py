"""``PagedKV`` copies made wrong on purpose, for tests that show a check catches them."""

from __future__ import annotations

from kvtier.connector.worker.pages import PagedKV


def off_by_one_byte(method: str):
    """``PagedKV.gather`` or ``scatter``, with one byte of what it wrote wrong."""
    copy = getattr(PagedKV, method)

    def gather(self, block_ids, slot):
        copy(self, block_ids, slot)
        slot[0] += 1  # layer 0, first page, first byte

    def scatter(self, slot, block_ids, first):
        copy(self, slot, block_ids, first)
        page = self.pages[0][next(b for b in block_ids if b != 0)]  # not vLLM's null block
        page[(0,) * page.dim()] += 1

    return gather if method == "gather" else scatter


def scatter_nothing(self, slot, block_ids, first):
    """A ``PagedKV.scatter`` that reports a load done and leaves the pages as they were."""
