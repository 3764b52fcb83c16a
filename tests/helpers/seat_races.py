"""Races on the writers' seats of a shared directory, played in one process: another
process's claim, or a second engine's start, made at the moment a claim writes its seat
(just before the first ``kvtier.segment.seats.write_seat`` of a ``with`` block), as two
processes of one host starting together make it now and then."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from unittest import mock

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment import seats as seats_module
from kvtier.segment.seats import claim_seat


@contextmanager
def before_first_seat(action: Callable[[], object]) -> Iterator[list[bool]]:
    """``action()`` run once, just before the first seat the block writes (the seats it writes
    itself are written as ever); the list yielded holds True once it ran."""
    real, ran = seats_module.write_seat, []

    def write_seat(seats, name, writer):
        if not ran:
            ran.append(True)
            action()
        return real(seats, name, writer)

    with mock.patch.object(seats_module, "write_seat", write_seat):
        yield ran


def claims_meanwhile(ns: Path, writer: str, writers: int) -> AbstractContextManager[list[bool]]:
    """Another process claiming a seat of ``writers`` on the directory ``ns`` under ``writer``
    just before the block's first seat is written; it gets the first seat."""
    def claim() -> None:
        with SafeDir.open(ns) as other:
            assert claim_seat(other, writer, writers) == 0

    return before_first_seat(claim)


def started_together(engine: Callable[[], KVStore]) -> tuple[KVStore, KVStore]:
    """Two stores ``engine()`` makes, the second started while the first writes its seat:
    (the first, the second)."""
    second: list[KVStore] = []
    with before_first_seat(lambda: second.append(engine())):
        first = engine()
    return first, second[0]
