"""Whether the file system under a path answers, within a deadline, before it is used.

A path on a network or FUSE file system whose server stopped answering (an NFS server
down under a hard mount, an NVMe-oF target gone, a FUSE daemon stopped) holds every call
on it, for ever: the kernel waits for the server, and a thread in such a call cannot be
stopped. So before a disk path is opened (at start, and at each try of a path out of
service) its file system is asked for its statistics (``statvfs``, which a network file
system always takes to its server, unlike a ``stat`` its attribute cache may answer) on a
daemon thread of its own, and the opener waits at most ``answer_wait(timeout)``: the
caller's timeout (``load_timeout``), never under ``MIN_WAIT_S`` (a busy server's answer is
not a hung mount's). A path that did not answer is out of service, and the engine starts
without it. A later try waits on the question still held, until its wait after it was
asked (a path that has not answered for that long fails at once), rather than leave
another thread behind it; a question held ``REASK_S`` is asked again, beside it (a mount
lazily unmounted and mounted anew answers the new one), with ``MAX_HELD`` threads held
per path at most. A path that answered within ``FRESH_S`` is not asked again.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future

from kvtier.io.guarded import start_thread

MIN_WAIT_S = 5.0  # the least a path's file system is given to answer
REASK_S = 60.0  # a question held this long is asked again beside it
MAX_HELD = 3  # threads held in unanswered questions per path, at most
FRESH_S = 5.0  # an answer this recent stands for the next question

_HELD: dict[str, tuple[Future[None], float]] = {}  # path -> its latest question unanswered
_RUNNING: Counter[str] = Counter()  # path -> its threads still asking
_ANSWERED: dict[str, float] = {}  # path -> when it last answered
_LOCK = threading.Lock()


def answer_wait(timeout: float | None) -> float | None:
    """How long a path is given to answer for a caller's ``timeout`` (None: as long as it takes)."""
    return None if timeout is None else max(timeout, MIN_WAIT_S)


def wait_for_answer(path: str, timeout: float | None, fresh_s: float = FRESH_S) -> None:
    """Return once the file system under ``path`` answered a ``statvfs`` within
    ``answer_wait(timeout)`` (None: as long as it takes, asked on this thread), or did
    within the last ``fresh_s`` seconds; raise ``TimeoutError`` when it did not, or the
    ``OSError`` it answered."""
    wait = answer_wait(timeout)
    if wait is None:
        os.statvfs(path)
        return
    now = time.monotonic()
    with _LOCK:
        if fresh_s > 0 and now - _ANSWERED.get(path, -fresh_s) < fresh_s:
            return
        held = _question(path, now)
    if held is None:  # no thread could be started: not answered this time
        raise TimeoutError(f"{path}: its file system could not be asked (no thread left)")
    asked, since = held
    try:  # a question older than its wait already: the path is known not to answer
        asked.result(max(0.0, since + wait - now))
    except TimeoutError as exc:
        if exc.errno is not None:  # its own answer (ETIMEDOUT): a soft mount's server is gone
            raise TimeoutError(exc.errno, f"{path}: its file system answered that its server "
                               f"timed out ({os.strerror(exc.errno)}; a soft mount whose "
                               "server does not answer?)") from None
        raise TimeoutError(f"{path}: its file system did not answer within {wait:g} s "
                           f"(asked {time.monotonic() - since:.0f} s ago; a hung mount?)") from None


def answers(path: str, timeout: float | None, fresh_s: float = FRESH_S) -> bool:
    """Whether the file system under ``path`` answers within its wait (``wait_for_answer``);
    one that answers with an error answers, but for ``ETIMEDOUT`` (a soft mount whose
    server is gone: every later call would wait as long)."""
    try:
        wait_for_answer(path, timeout, fresh_s)
    except TimeoutError:
        return False
    except Exception:  # (``OSError``, or a path ``statvfs`` refuses: the open says which)
        return True
    return True


def outstanding() -> int:
    """Threads asking still, their questions unanswered (each held in a hung call)."""
    with _LOCK:
        return sum(_RUNNING.values())


def ask(paths: Iterable[str], timeout: float | None) -> None:
    """Ask each of ``paths`` now, waiting for none (their waits then run together: several
    hung paths cost one wait, not one each)."""
    if answer_wait(timeout) is None:
        return
    now = time.monotonic()
    with _LOCK:
        for path in paths:
            if now - _ANSWERED.get(path, -FRESH_S) >= FRESH_S:
                _question(path, now)


def _question(path: str, now: float) -> tuple[Future[None], float] | None:
    """The question of ``path`` to wait on (lock held): the latest held, or a new one where
    none is, or it was asked ``REASK_S`` ago (``MAX_HELD`` threads a path at most)."""
    held = _HELD.get(path)
    if (held is None or now - held[1] >= REASK_S) and _RUNNING[path] < MAX_HELD:
        held = _ask_anew(path, now)
    return held


def _ask_anew(path: str, now: float) -> tuple[Future[None], float] | None:
    """A new question of ``path`` on a thread of its own (lock held), or None when no
    thread starts (the latest question stays)."""
    asked: Future[None] = Future()
    if not start_thread(threading.Thread(target=_ask, args=(path, asked), daemon=True,
                                         name=f"kvtier-answer {path}")):
        return _HELD.get(path)
    _RUNNING[path] += 1
    _HELD[path] = (asked, now)
    return _HELD[path]


def _ask(path: str, asked: Future[None]) -> None:
    error: BaseException | None = None
    try:
        os.statvfs(path)
    except BaseException as exc:  # an answer, whatever it is (a path statvfs refuses too)
        error = exc
    with _LOCK:  # no longer outstanding once its answer is out
        _RUNNING[path] -= 1
        if _RUNNING[path] <= 0:
            del _RUNNING[path]
        if _HELD.get(path, (None,))[0] is asked:
            del _HELD[path]
        if error is None:
            _ANSWERED[path] = time.monotonic()
    if error is None:
        asked.set_result(None)
    else:
        asked.set_exception(error)
