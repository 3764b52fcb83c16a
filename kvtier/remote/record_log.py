"""Reading a store's log of token records (a Valkey/Redis stream, as ``XRANGE`` answers it):
each entry's key and record, whatever else a hostile writer put there."""

from __future__ import annotations

from typing import Any


def stream_entries(reply: Any, after: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(the last entry's id, or ``after`` when none; each entry's ``k`` and ``r`` fields)
    from an ``XRANGE`` reply: entries as (id, fields) with fields as a mapping or a flat
    list. An entry without both fields as bytes is passed over; a reply of another shape
    reads as no entries."""
    last, entries = after, list[tuple[bytes, bytes]]()
    if not isinstance(reply, list | tuple):
        return last, entries
    for entry in reply:
        if not isinstance(entry, list | tuple) or len(entry) != 2 or not isinstance(entry[0], bytes):
            continue
        last, fields = entry[0], entry[1]
        if isinstance(fields, list | tuple):
            fields = dict(zip(fields[::2], fields[1::2], strict=False))
        if not isinstance(fields, dict):
            continue
        key, record = fields.get(b"k"), fields.get(b"r")
        if isinstance(key, bytes) and isinstance(record, bytes):
            entries.append((key, record))
    return last, entries
