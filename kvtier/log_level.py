"""``KVTIER_LOG_LEVEL``: how much kvtier logs, read when a store or connector starts.

kvtier logs under the ``kvtier`` logger and leaves handlers to the application (vLLM, or
the caller's ``logging`` setup). The variable sets that logger's level: ``debug`` shows every
failure, not only the first of each kind (``FailureLog``), and each path's retries. Python's
last-resort handler shows only warnings and above, so below ``warning``, when nothing in
the process would show a record of the ``kvtier`` logger, a handler to stderr is added.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from kvtier.errors import ConfigError

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
