"""Whether O_DIRECT works in a segment's directory: one aligned page written and read back
through a probe file (a ``TEMP_NAME``), removed after."""

from __future__ import annotations

import os
import secrets

from kvtier.io.buffers import PAGE, AlignedBuffer
from kvtier.io.safefs import SafeDir


def probe_o_direct(directory: SafeDir) -> bool:
    """True when O_DIRECT writes and reads of one aligned page work in ``directory``."""
    name = f".o_direct_probe-{os.getpid()}-{secrets.token_hex(4)}"
    buffer = AlignedBuffer(PAGE, pin=False)
    try:
        fd = directory.open_file(name, os.O_RDWR | os.O_EXCL | os.O_DIRECT, create=True)
    except OSError:
        buffer.close()
        return False
    try:
        os.pwritev(fd, [buffer.array.data], 0)
        return os.preadv(fd, [buffer.array.data], 0) == PAGE
    except OSError:
        return False
    finally:
        os.close(fd)
        directory.remove_file(name)
        buffer.close()
