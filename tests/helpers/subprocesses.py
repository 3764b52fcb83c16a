"""What every server a test or benchmark starts shares: it dies with the process that
started it, however that process dies (a SIGKILL, the OOM killer), so none is left
listening after a killed run."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """(``preexec_fn``: in the child, before exec) Be sent SIGKILL when the thread that
    started this process ends: start servers from a thread that lives as long as they do."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
