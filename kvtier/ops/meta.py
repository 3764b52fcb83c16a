"""A namespace's ``namespace.json`` as the offline commands trust it: only when the digest of
the namespace it describes is its directory's name and its slot geometry is the one kvtier
derives from that namespace (``parse_meta``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvtier.io.format import HEADER_BYTES
from kvtier.keys import FORMAT_VERSION, namespace_id_of
from kvtier.segment.index_file import MAX_RAW_BYTES, SlotLayout, file_slots_for


class MetaError(ValueError):
    """A ``namespace.json`` that cannot be trusted; the message says why."""


@dataclass(frozen=True)
class NamespaceMeta:
    """What a trusted ``namespace.json`` says."""

    namespace: dict
    stride: int
    raw_bytes: int
    file_slots: int

    @property
    def format_version(self) -> int:
        version = self.namespace.get("format_version", 0)
        return version if isinstance(version, int) else 0


def parse_meta(data: bytes, namespace_id: str) -> NamespaceMeta:
    """Check a ``namespace.json`` against its directory's name; raise ``MetaError``."""
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise MetaError(f"not JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("namespace"), str):
        raise MetaError("not a kvtier namespace description")
    try:
        described = namespace_id_of(meta["namespace"])
    except UnicodeEncodeError:  # a lone surrogate (JSON "\\ud800"): not text kvtier writes
        raise MetaError("its namespace is not UTF-8 text") from None
    if described != namespace_id:
        raise MetaError("describes another namespace than the directory's name")
    try:
        namespace = json.loads(meta["namespace"])
    except (ValueError, RecursionError) as exc:
        raise MetaError(f"its namespace is not JSON ({exc})") from None
    if not isinstance(namespace, dict):
        raise MetaError("not a kvtier namespace description")
    numbers: dict[str, int] = {}
    for key in ("stride", "raw_bytes", "file_slots"):
        value = meta.get(key)
        if type(value) is not int or not 0 < value <= MAX_RAW_BYTES + HEADER_BYTES:
            raise MetaError(f"{key} is {value!r}, not a size kvtier writes")
        numbers[key] = value
    result = NamespaceMeta(namespace, **numbers)
    if result.format_version == FORMAT_VERSION:
        stride = SlotLayout(result.raw_bytes, 1, 0).stride
        if result.stride != stride or result.file_slots != file_slots_for(stride):
            raise MetaError(f"stride {result.stride} and file_slots {result.file_slots} do not "
                            f"match raw_bytes {result.raw_bytes} (kvtier writes {stride} and "
                            f"{file_slots_for(stride)})")
    return result
