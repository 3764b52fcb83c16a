"""Whether the file system under a path answers, within a deadline, before it is used.

A path on a network or FUSE file system whose server stopped answering (an NFS server down
under a hard mount, an NVMe-oF target gone, a FUSE daemon stopped) holds every call on it,
for ever: the kernel waits for the server, and a thread in such a call cannot be stopped. So
before a disk path is opened (at start, and at each try of a path out of service) its file
system is asked for its statistics (``statvfs``, which a network file system always takes to
its server, unlike a ``stat`` its attribute cache may answer), then to open the path's
directory (a FUSE daemon may answer the first from its own state while its back end hangs),
on a daemon thread of its own, and the opener waits at most ``answer_wait(timeout)``: the
caller's timeout (``load_timeout``), never under ``MIN_WAIT_S`` (a busy server's answer is
not a hung mount's). A path that did not answer is out of service, and the engine starts
without it. A later try waits on the question still held, until its wait after it was asked
(a path that has not answered for that long fails at once), rather than leave another thread
behind it; a question held ``REASK_S`` is asked again, beside it, with ``MAX_HELD`` threads
held per path at most; a path whose mount was lazily unmounted and mounted anew (a new mount
ID in ``/proc/self/mountinfo``) is asked afresh at once, however many threads the hung mount
holds. A path that answered within ``FRESH_S`` is not asked again (unless the caller says
otherwise: ``fresh_s``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future

from kvtier.io.guarded import start_thread
from kvtier.io.mounts import mount_of, mounts_of

MIN_WAIT_S = 5.0  # the least a path's file system is given to answer
REASK_S = 60.0  # a question held this long is asked again beside it
MAX_HELD = 3  # threads held in unanswered questions per path, at most
FRESH_S = 5.0  # an answer this recent stands for the next question

# questions are kept by (path, the ID of the mount it is under): a mount lazily unmounted
# and mounted anew is asked afresh, however many threads the hung one holds
Where = tuple[str, int | None]
_HELD: dict[Where, tuple[Future[None], float]] = {}  # its latest question unanswered
_RUNNING: Counter[Where] = Counter()  # its threads still asking
_ANSWERED: dict[str, float] = {}  # path -> when it last answered
_LOCK = threading.Lock()


def answer_wait(timeout: float | None) -> float | None:
    """How long a path is given to answer for a caller's ``timeout`` (None: as long as it takes)."""
    return None if timeout is None else max(timeout, MIN_WAIT_S)


def wait_for_answer(path: str, timeout: float | None, fresh_s: float = FRESH_S) -> None:
    """Return once the file system under ``path`` answered (``statvfs``, an open) within
    ``answer_wait(timeout)`` (None: as long as it takes, asked on this thread), or did
    within the last ``fresh_s`` seconds; raise ``TimeoutError`` when it did not, or the
    ``OSError`` it answered."""
    wait = answer_wait(timeout)
    if wait is None:
        _asked(path)
        return
    now = time.monotonic()
    if fresh_s > 0 and now - _ANSWERED.get(path, -fresh_s) < fresh_s:
        return  # (one dict read: no mount table read, no lock, for the common case)
    where = (path, mount_of(path))
    with _LOCK:
        held = _question(where, now)
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


def outstanding(path: str | None = None) -> int:
    """Threads asking still, their questions unanswered (each held in a hung call): of
    ``path`` alone, or of every path (None)."""
    with _LOCK:
        return sum(n for where, n in _RUNNING.items() if path is None or where[0] == path)


def ask(paths: Iterable[str], timeout: float | None, fresh_s: float = FRESH_S) -> None:
    """Ask each of ``paths`` now (but those that answered within ``fresh_s``), waiting for
    none (their waits then run together: several hung paths cost one wait, not one each)."""
    if answer_wait(timeout) is None:
        return
    now = time.monotonic()
    due = [path for path in paths
           if fresh_s <= 0 or now - _ANSWERED.get(path, -fresh_s) >= fresh_s]
    if not due:
        return
    wheres = list(zip(due, mounts_of(due), strict=True))  # the mount table read once
    with _LOCK:
        for where in wheres:
            _question(where, now)


def _question(where: Where, now: float) -> tuple[Future[None], float] | None:
    """The question of a path to wait on (lock held): the latest held, or a new one where
    none is, or it was asked ``REASK_S`` ago (``MAX_HELD`` threads a path and mount at
    most)."""
    held = _HELD.get(where)
    if (held is None or now - held[1] >= REASK_S) and _RUNNING[where] < MAX_HELD:
        held = _ask_anew(where, now)
    return held


def _ask_anew(where: Where, now: float) -> tuple[Future[None], float] | None:
    """A new question of a path on a thread of its own (lock held), or None when no
    thread starts (the latest question stays)."""
    asked: Future[None] = Future()
    if not start_thread(threading.Thread(target=_ask, args=(where, asked), daemon=True,
                                         name=f"kvtier-answer {where[0]}")):
        return _HELD.get(where)
    _RUNNING[where] += 1
    _HELD[where] = (asked, now)
    return _HELD[where]


def _asked(path: str) -> None:
    """What a path is asked: its file system's statistics, then an open of its directory,
    as ``SafeDir.open`` opens it (no symlink followed; never blocking on a special file:
    ``O_DIRECTORY`` refuses one before opening it). Whatever it raises is its answer."""
    os.statvfs(path)
    os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC))


def _ask(where: Where, asked: Future[None]) -> None:
    error: BaseException | None = None
    try:
        _asked(where[0])
    except BaseException as exc:  # an answer, whatever it is (a path statvfs refuses too)
        error = exc
    with _LOCK:  # no longer outstanding once its answer is out
        _RUNNING[where] -= 1
        if _RUNNING[where] <= 0:
            del _RUNNING[where]
        if _HELD.get(where, (None,))[0] is asked:
            del _HELD[where]
        if error is None:
            _ANSWERED[where[0]] = time.monotonic()
    if error is None:
        asked.set_result(None)
    else:
        asked.set_exception(error)
