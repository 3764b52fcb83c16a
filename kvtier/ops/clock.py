"""The filesystem's clock as the offline commands read it, for one namespace.

A lease's age is the lease file's modification time against the time now by the clock that
sets file times (``kvtier.segment.lease_age``), read from a file made for the purpose. The
commands make that file only in a namespace directory kvtier provably wrote
(``NamespaceDir.owned``: its ``namespace.json`` trusted, or a slot proving it kvtier's before
a removal), never in a segment directory nor in a directory not proven kvtier's, whose
owner's files kvtier does not touch. Where none may be made (a namespace not proven
kvtier's) or none can be (a read-only mount, a full disk), the time is not known: a lease
this machine wrote is dated by the time it states, the age of any other is not told (a lease
another machine left open counts as in use), and ``problem`` says why, for the report.
"""

from __future__ import annotations

import os

from kvtier.io.safefs import UnsafeEntry
from kvtier.ops.cache import NamespaceDir, error_text
from kvtier.segment.lease_age import read_filesystem_clock

NOT_TOLD = "the age of a lease another machine wrote is not told, and one it left open counts as in use"


class NamespaceClock:
    """Contract: calling it returns the time now by the filesystem's clock, read afresh in
    the namespace's own directory, or None when it is not known; ``problem`` then says why
    ("" while every reading worked)."""

    def __init__(self, ns: NamespaceDir) -> None:
        self.ns, self.problem = ns, ""

    def __call__(self) -> int | None:
        if not self.ns.owned:
            why = self.ns.problem or "no namespace.json"
            self.problem = (f"the filesystem's clock is not read: {self.ns.path} is not proven "
                            f"kvtier's ({why}), and no file is made in it; {NOT_TOLD}")
            return None
        try:
            with self.ns.open() as directory:
                return read_filesystem_clock(directory)
        except OSError as exc:
            why = error_text(exc) if isinstance(exc, UnsafeEntry) or not exc.errno else os.strerror(exc.errno)
            self.problem = (f"the filesystem's clock cannot be read: no file can be made in "
                            f"{self.ns.path} ({why}); {NOT_TOLD}")
            return None


def namespace_now(ns: NamespaceDir) -> int | None:
    """The time now by the clock that sets file times in ``ns`` (``NamespaceClock``)."""
    return NamespaceClock(ns)()
