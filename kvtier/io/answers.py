"""Whether the file system under a path answers, within a deadline, before it is used.

A path on a network or FUSE file system whose server stopped answering (an NFS server
down under a hard mount, an NVMe-oF target gone, a FUSE daemon stopped) holds every call
on it, for ever: the kernel waits for the server, and a thread in such a call cannot be
stopped. So before a disk path is opened (at start, and at each try of a path out of
service) its file system is asked for its statistics (``statvfs``, which a network file
system always takes to its server, unlike a ``stat`` its attribute cache may answer) on a
daemon thread of its own, and the opener waits ``timeout`` seconds at most: a path that
did not answer is out of service, and the engine starts without it. At most one question
per path is outstanding: a later try waits on the one still held, until ``timeout`` after
it was asked, rather than leave another thread behind it (a path that has not answered
for that long fails at once).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

_HELD: dict[str, tuple[Future[None], float]] = {}  # path -> its question still unanswered
_LOCK = threading.Lock()


def wait_for_answer(path: str, timeout: float | None) -> None:
    """Return once the file system under ``path`` answered a ``statvfs`` within ``timeout``
    seconds (None: wait as long as it takes, on this thread); raise ``TimeoutError`` when it
    did not, or the ``OSError`` it answered."""
    if timeout is None:
        os.statvfs(path)
        return
    with _LOCK:
        held = _HELD.get(path)
        if held is None:
            held = (Future(), time.monotonic())
            _HELD[path] = held
            threading.Thread(target=_ask, args=(path, held[0]), daemon=True,
                             name=f"kvtier-answer {path}").start()
    asked, since = held
    try:  # a question older than ``timeout`` already: the path is known not to answer
        asked.result(max(0.0, since + timeout - time.monotonic()))
    except TimeoutError:
        raise TimeoutError(f"{path}: its file system did not answer within {timeout:g} s "
                           f"(asked {time.monotonic() - since:.0f} s ago; a hung mount?)") from None


def answers(path: str, timeout: float | None) -> bool:
    """Whether the file system under ``path`` answers within ``timeout`` (``wait_for_answer``);
    one that answers with an error answers."""
    try:
        wait_for_answer(path, timeout)
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def outstanding() -> int:
    """Questions asked and not answered yet (each holds a thread, in a hung call)."""
    with _LOCK:
        return len(_HELD)


def _ask(path: str, asked: Future[None]) -> None:
    error = None
    try:
        os.statvfs(path)
    except OSError as exc:
        error = exc
    with _LOCK:  # no longer outstanding once its answer is out
        if _HELD.get(path, (None,))[0] is asked:
            del _HELD[path]
    if error is None:
        asked.set_result(None)
    else:
        asked.set_exception(error)
