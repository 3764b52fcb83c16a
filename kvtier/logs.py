"""The ``kvtier`` logger: how much it logs (``KVTIER_LOG_LEVEL``, read when a store or
connector starts), and failures logged once per kind rather than once per chunk.

kvtier logs under the ``kvtier`` logger and leaves handlers to the application (vLLM, or
the caller's ``logging`` setup). The variable sets that logger's level: ``debug`` shows every
failure, not only the first of each kind (``FailureLog``), and each path's retries. Python's
last-resort handler shows only warnings and above, so below ``warning``, when nothing in
the process would show a record of the ``kvtier`` logger, a handler to stderr is added.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier")

LOG_LEVEL_VAR = "KVTIER_LOG_LEVEL"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


def log_level(environ: Mapping[str, str]) -> int | None:
    """The level ``KVTIER_LOG_LEVEL`` names (None: unset or empty); ``ConfigError`` for
    any other value."""
    text = environ.get(LOG_LEVEL_VAR, "").strip().lower()
    if not text:
        return None
    if text not in LEVELS:
        raise ConfigError(f"kvtier config: bad value {environ[LOG_LEVEL_VAR][:40]!r} for "
                          f"{LOG_LEVEL_VAR}; allowed: {' | '.join(LEVELS)}")
    return LEVELS[text]


def apply_log_level(environ: Mapping[str, str] | None = None,
                    logger: logging.Logger | None = None) -> None:
    """Set the ``kvtier`` logger's level (``logger``: another, for tests) from
    ``KVTIER_LOG_LEVEL``; unset, nothing changes."""
    level = log_level(os.environ if environ is None else environ)
    if level is None:
        return
    logger = logging.getLogger("kvtier") if logger is None else logger
    logger.setLevel(level)
    if level < logging.WARNING and not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class FailureLog:
    """Log the first failure of each kind at WARNING, the rest at DEBUG (thread-safe).

    A kind is a short fixed phrase ("disk read corrupt", "load failed (KeyError)"): a fault
    that hits every chunk of every request is one log line, and its counters say how often.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, kind: str, detail: str, exc: BaseException | None = None) -> None:
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        if not first:
            log.debug("kvtier %s: %s", kind, detail)
            return
        log.warning("kvtier %s: %s (further ones are counted, not logged)", kind, detail,
                    exc_info=exc)

    def seen(self) -> set[str]:
        """The kinds logged so far."""
        with self._lock:
            return set(self._seen)
