"""Why a store did not plan a chunk (``put``) or fetch it (``get``)."""

from __future__ import annotations

from enum import Enum


class Skip(Enum):
    """Why a chunk was not planned (``put``) or fetched (``get``)."""

    PRESENT = "present"  # put: cached already, or being written
    NO_ROOM = "no room"  # no slot free now
    NO_ROOM_BELOW = "no room below"  # get: room only by dropping a later chunk of its own
    BUSY = "busy"  # get: another get is reading it into host memory: wait for that
    END = "end"  # get: not cached, or its staging slot could not be written back in time
