"""The names kvtier gives the entries of a cache root, and how they nest.

    <disk path>/<namespace id>/              one namespace (32 hex digits), mode 0700
        namespace.json                       what the namespace is (for the CLI)
        halt.json                            hits stopped: wrong KV found (kvtier.segment.halt_file)
        seats/seat-NNNN                      a writer's seat (its id): at most share_writers
        writers/<writer id>/                 one writer's segment: only that writer writes it
            lock                             held with flock by the writing process
            lease                            its heartbeat (kvtier.segment.lease)
            slots-NNNN.kvt                   fixed-size slots (kvtier.io.format)
            index.kvt                        a copy of each slot's header, one entry per slot
            log.kvt                          the same entries, appended (kvtier.segment.log)

Names never come from key material; writer ids are validated (``WRITER_ID``).
"""

from __future__ import annotations

import re
import socket

from kvtier.config.values import WRITER_ID

META_FILE = "namespace.json"
HALT_FILE = "halt.json"
WRITERS_DIR = "writers"
SEATS_DIR = "seats"
SEAT_FILE = "seat-{:04d}"
SEAT_NAME = re.compile(r"seat-([0-9]{4})", re.ASCII)  # share_writers is at most 4096
LOCK_FILE = "lock"
INDEX_FILE = "index.kvt"
LEASE_FILE = "lease"
LOG_FILE = "log.kvt"
SLOT_FILE = "slots-{:04d}.kvt"
SLOT_NAME = re.compile(r"slots-([0-9]{4,9})\.kvt", re.ASCII)  # see ``slot_number``
# Entries of a directory an engine lists at most (more are not kvtier's: the directory is
# refused, or the rest not looked at): ``seats/`` holds at most 4096 seats (share_writers)
# and their temporary files; a segment its slot files (8 GiB each) and a few of its own.
SEATS_LISTED = 8192
SEGMENT_LISTED = 4096
NAMESPACE_NAME = re.compile(r"[0-9a-f]{32}")
# Temporary and probe files kvtier makes: ``.<name>.tmp-<pid>-<8 hex>`` (``SafeDir.replace_file``,
# ``write_seat`` and ``CacheDir.replace_index``), ``.o_direct_probe-<pid>-<8 hex>``,
# ``.clock_probe-<pid>-<8 hex>`` (``lease_age.filesystem_now_ns``); ``-<pid>`` alone: an older
# version's.
TEMP_NAME = re.compile(r"\.(?:(?:namespace\.json|halt\.json|lease|log\.kvt|index\.kvt|seat)\.tmp"
                       r"|o_direct_probe|clock_probe)"
                       r"-[1-9][0-9]{0,9}(?:-[0-9a-f]{8})?", re.ASCII)

__all__ = ["HALT_FILE", "INDEX_FILE", "LEASE_FILE", "LOCK_FILE", "LOG_FILE", "META_FILE", "NAMESPACE_NAME",
           "SEATS_DIR", "SEATS_LISTED", "SEAT_FILE", "SEAT_NAME", "SEGMENT_LISTED", "SLOT_FILE",
           "SLOT_NAME", "TEMP_NAME", "WRITERS_DIR", "WRITER_ID", "seat_number", "slot_number"]


def _number(name: str, pattern: re.Pattern[str], written: str) -> int | None:
    match = pattern.fullmatch(name)
    if match is None:
        return None
    number = int(match.group(1))
    return number if written.format(number) == name else None


def slot_number(name: str) -> int | None:
    """The number of the slot file ``name``, or None when kvtier never writes that name:
    only ``SLOT_FILE.format(n)`` itself counts (ASCII digits, no extra leading zero), so
    that no other file is ever read, truncated or deleted as a slot file."""
    return _number(name, SLOT_NAME, SLOT_FILE)


def seat_number(name: str) -> int | None:
    """The number of the seat file ``name``, or None when it is not ``SEAT_FILE.format(n)``."""
    return _number(name, SEAT_NAME, SEAT_FILE)


def host_name() -> str:
    """This machine's name, as leases and default writer ids show it."""
    return socket.gethostname() or "localhost"


MAX_DEFAULT_WRITERS = 64  # writer ids tried on one host when none is configured


def default_writer_ids(host: str) -> list[str]:
    """The writer ids tried, in order, when ``instance_id`` is not set: ``<host>-0``,
    ``<host>-1``, ... (the host name cut to the characters a writer id allows), so that a
    process restarted on the same host takes the lowest one free: its own segment again."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", host.split(".")[0])[:56].strip("-._") or "host"
    return [f"{clean}-{n}" for n in range(MAX_DEFAULT_WRITERS)]


def writer_ids(instance_id: str | None) -> list[str]:
    """The writer ids to try, in order: the configured one, else ``default_writer_ids``."""
    return [instance_id] if instance_id else default_writer_ids(host_name())
