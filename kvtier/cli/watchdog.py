"""A whole command's deadline where its steps cannot check one: the offline commands over a
cache root (``inspect``, ``verify``, ``gc``, ``clear PATH``) wait on a filesystem, and a
network filesystem that stopped answering holds a read or an unlink without end.

``watchdog(seconds, command)`` ends the process when ``seconds`` pass before its block is
over: one line on stderr naming the command and the timeout, then exit status 1. Nothing is
left half-done that a crash would not leave: every change these commands make is one
``unlink``, one punched hole or one header written, each whole or not at all.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.cli.app import fail

EXIT_TIMED_OUT = 1


@contextmanager
def watchdog(seconds: float, command: str, left: float | None = None) -> Iterator[None]:
    """End the process ``seconds`` from now (``left``: what remains of them, when some went
    by already), unless the block is over first."""
    if not seconds > 0:  # NaN too
        raise fail(f"{command}: --timeout must be a positive number of seconds, not {seconds:g}")
    if math.isinf(seconds) or seconds >= threading.TIMEOUT_MAX:  # no deadline asked for
        yield
        return

    def expire() -> None:
        sys.stderr.write(f"kvtier: {command}: --timeout {seconds:g} s ran out before it was "
                         "over (a cache directory that does not answer, such as a hung "
                         "network filesystem, or a larger cache than the timeout allows: give "
                         "a longer --timeout)\n")
        sys.stderr.flush()
        os._exit(EXIT_TIMED_OUT)  # a thread blocked in the kernel cannot be interrupted

    timer = threading.Timer(seconds if left is None else max(0.001, left), expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
