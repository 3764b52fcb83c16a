"""Looks at disk paths that may hold their caller for ever, bounded in time, one at most
under way per path and kind of look.

A path's file system may answer its statistics (``kvtier.io.answers``) and then hold every
open, lookup or read: a FUSE daemon whose back end hung, a mount that stopped answering
just after it answered. A look that must not hold its caller (an engine's start, a step)
runs on a daemon thread and is waited for until a deadline (``run_bounded``); a path whose
look of that kind is still under way from an earlier call is not looked at again (no
thread more is left behind it) and counts, as one not over in time, as not answered; nor
is one with a look of any kind still under way past its deadline (a path whose open hung
is not waited for again by every other look at it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

from kvtier.io.bounded_jobs import run_bounded

T = TypeVar("T")
log = logging.getLogger("kvtier")

# (path, kind) of each look still running -> (the look, whether it is past its deadline:
# its caller went on without it, and other kinds of look pass the path over)
_UNDER_WAY: dict[tuple[str, str], tuple[object, bool]] = {}
_LOCK = threading.Lock()


def look_at_roots(roots: Iterable[str], look: Callable[[str], T], wait: float | None,
                  kind: str, left_over: Callable[[T], None] | None = None,
                  blocks_others: bool = True) -> dict[str, T | BaseException]:
    """``look(root)`` for each of ``roots`` at once, each on a daemon thread named
    ``kind``, waited for ``wait`` seconds together (None: as long as they take); by root,
    what each that ended in time returned or raised. A root missing did not end in time,
    or still had a look of ``kind`` under way, or one of any kind past its deadline: it was
    not looked at again. What a look returns after its wait goes to ``left_over`` (what one
    raises is logged), and only then is that look over. Without ``blocks_others`` a look
    past its deadline keeps only looks of its own kind off the root (a look that may be
    slow on a healthy mount: reading many writers' logs)."""
    this = object()  # these looks (a later call's looks of the same kind are others)
    with _LOCK:
        late = {root for (root, _), (_, past) in _UNDER_WAY.items() if past}
        due = [root for root in dict.fromkeys(roots)
               if (root, kind) not in _UNDER_WAY and root not in late]
        _UNDER_WAY.update(((root, kind), (this, False)) for root in due)

    def ended_late(root: str, outcome: T | BaseException) -> None:
        try:
            if isinstance(outcome, BaseException):  # its caller went on: said here, once
                log.info("kvtier: a look at %s (%s) that ended past its wait failed: %s",
                         root, kind, outcome)
            elif left_over is not None:
                left_over(outcome)
        finally:
            _over(root, kind, this)

    done = run_bounded({root: partial(look, root) for root in due}, wait, kind, ended_late)
    with _LOCK:
        for root in due:
            if _UNDER_WAY.get((root, kind), (None,))[0] is this:  # (not ended late since)
                if root in done:
                    del _UNDER_WAY[(root, kind)]
                else:
                    _UNDER_WAY[(root, kind)] = (this, blocks_others)
    return done


def under_way(kind: str) -> list[str]:
    """The paths whose look of ``kind`` has not ended."""
    with _LOCK:
        return sorted(root for root, of in _UNDER_WAY if of == kind)


def stuck(root: str) -> bool:
    """Whether a look of any kind at ``root`` is still under way past its deadline."""
    with _LOCK:
        return any(past for (at, _), (_, past) in _UNDER_WAY.items() if at == root)


def _over(root: str, kind: str, look: object) -> None:
    with _LOCK:
        if _UNDER_WAY.get((root, kind), (None,))[0] is look:
            del _UNDER_WAY[(root, kind)]
