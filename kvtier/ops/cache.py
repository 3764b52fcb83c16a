"""Finding the namespaces in a cache directory and reading what they hold, offline.

A cache root is one ``disk_paths`` entry, and everything below it is hostile: entries are
opened through :class:`~kvtier.io.safefs.SafeDir` (no symlink followed, regular files and
directories of this user only, bounded reads). A namespace is a directory named by 32 hex
digits; its ``namespace.json`` is trusted only when the digest of the namespace it describes
is the directory's name and its slot geometry is the one kvtier derives from it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.io.cachedir import INDEX_FILE, LOCK_FILE, MAX_META_BYTES, META_FILE, SLOT_NAME, lock_namespace
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, HeaderError, SlotHeader, decode_header, is_blank
from kvtier.io.index_file import MAX_RAW_BYTES, MAX_SLOTS, SlotLayout, file_slots_for, valid_header
from kvtier.io.safefs import CacheDirError, SafeDir, read_at
from kvtier.keys import FORMAT_VERSION, namespace_id_of

CacheRootError = CacheDirError  # a path the commands must not operate on, and why
NAMESPACE_NAME = re.compile(r"[0-9a-f]{32}")


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
    if namespace_id_of(meta["namespace"]) != namespace_id:
        raise MetaError("describes another namespace than the directory's name")
    namespace = json.loads(meta["namespace"])
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


@dataclass(frozen=True)
class NamespaceDir:
    """One namespace directory under ``root``: its trusted metadata, or why there is none
    (``problem``); ``unsafe`` when the directory itself or its metadata file breaks the
    hostile-directory rule (then no command changes anything in it)."""

    root: Path
    id: str
    meta: NamespaceMeta | None
    problem: str = ""
    unsafe: bool = False
    has_meta_file: bool = False

    @property
    def path(self) -> Path:
        return self.root / self.id

    @property
    def namespace(self) -> dict:
        return self.meta.namespace if self.meta else {}

    @property
    def status(self) -> str:
        """ok | stale (another format version) | damaged (namespace.json not trusted) |
        orphaned (no namespace.json) | unsafe."""
        if self.unsafe:
            return "unsafe"
        if self.meta is None:
            return "damaged" if self.has_meta_file else "orphaned"
        return "ok" if self.meta.format_version == FORMAT_VERSION else "stale"

    @property
    def readable(self) -> bool:
        """True when its slots can be read with its metadata's geometry."""
        return self.status == "ok"

    @property
    def readable_meta(self) -> NamespaceMeta:
        """``meta`` of a ``readable`` directory (code that reads slots runs only on those)."""
        assert self.meta is not None, f"namespace {self.id} has no trusted namespace.json"
        return self.meta

    def open(self) -> SafeDir:
        with SafeDir.open(self.root) as top:
            return top.subdir(self.id)


def cache_root(path: str | Path) -> Path:
    """``path`` checked to be a real directory of this user; raises ``CacheRootError``."""
    with SafeDir.open(path):
        return Path(path)


def namespaces(root: Path) -> list[NamespaceDir]:
    """The namespace directories directly under ``root`` (other entries are not kvtier's)."""
    found: list[NamespaceDir] = []
    with SafeDir.open(root) as top:
        for name in top.names():
            info = top.lstat(name) if NAMESPACE_NAME.fullmatch(name) else None
            if info is None or not stat.S_ISDIR(info.st_mode):
                continue
            try:
                with top.subdir(name) as directory:
                    described = _describe(root, name, directory)
            except OSError as exc:
                described = NamespaceDir(root, name, None, exc.strerror or str(exc), unsafe=True)
            if described is not None:
                found.append(described)
    return found


def _describe(root: Path, name: str, directory: SafeDir) -> NamespaceDir | None:
    names = directory.names()
    if META_FILE not in names and not any(SLOT_NAME.fullmatch(n) for n in names):
        return None
    try:
        data = directory.read_file(META_FILE, MAX_META_BYTES)
    except OSError as exc:
        return NamespaceDir(root, name, None, exc.strerror or str(exc), unsafe=True,
                            has_meta_file=True)
    if data is None:
        return NamespaceDir(root, name, None, "no namespace.json")
    try:
        return NamespaceDir(root, name, parse_meta(data, name), has_meta_file=True)
    except MetaError as exc:
        return NamespaceDir(root, name, None, f"namespace.json: {exc}", has_meta_file=True)


def slot_files(directory: SafeDir) -> dict[int, str]:
    """Slot file names by number (only names kvtier writes)."""
    files = {}
    for name in directory.names():
        match = SLOT_NAME.fullmatch(name)
        if match:
            files[int(match.group(1))] = name
    return dict(sorted(files.items()))


def slot_file_sizes(ns: NamespaceDir, directory: SafeDir) -> dict[int, int]:
    """Bytes of each slot file, as far as slots can be (a file is never longer than its
    ``file_slots`` slots); ``UnsafeEntry`` when one is not a regular file of this user."""
    limit = ns.meta.stride * ns.meta.file_slots if ns.meta else 0
    sizes = {}
    for number, name in slot_files(directory).items():
        if ns.meta and number * ns.meta.file_slots >= MAX_SLOTS:
            continue  # past any capacity kvtier keeps: not its file
        fd = directory.open_file(name, os.O_RDONLY)
        try:
            sizes[number] = min(os.fstat(fd).st_size, limit)
        finally:
            os.close(fd)
    return sizes


def is_proven(ns: NamespaceDir, directory: SafeDir) -> bool:
    """True when kvtier provably wrote this namespace: trusted metadata, or a slot whose
    checked header names the directory's namespace."""
    if ns.meta is not None:
        return True
    digest = bytes.fromhex(ns.id)
    for name in slot_files(directory).values():
        try:
            fd = directory.open_file(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            header = decode_header(read_at(fd, HEADER_BYTES, 0))
        except (HeaderError, OSError):
            continue
        finally:
            os.close(fd)
        if header.namespace == digest:
            return True
    return False


def in_use(ns: NamespaceDir) -> bool:
    """True when a running kvtier process holds the namespace's lock."""
    if ns.unsafe:
        return False
    try:
        with ns.open() as directory:
            fd = directory.open_file(LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False  # no lock file (or one that is not kvtier's): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def hold(directory: SafeDir) -> int:
    """Take the namespace's lock for an operation that changes it; raise if it is in use."""
    return lock_namespace(directory, "stop it first")


def index_entries(ns: NamespaceDir, directory: SafeDir,
                  sizes: dict[int, int]) -> list[tuple[int, SlotHeader | None]]:
    """(slot, header, or None when the entry is bad or names a slot past the end of the
    files) for every non-blank entry of the index file, read no further than the files."""
    if ns.meta is None:
        return []
    stride, per_file = ns.meta.stride, ns.meta.file_slots
    slots = (max(sizes) + 1) * per_file if sizes else 0
    try:
        fd = directory.open_file(INDEX_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return []
    try:
        data = read_at(fd, min(os.fstat(fd).st_size, slots * INDEX_ENTRY_BYTES), 0)
    finally:
        os.close(fd)
    layout = SlotLayout(ns.meta.raw_bytes, 1, slots * stride)
    digest = bytes.fromhex(ns.id)
    entries = []
    for slot in range(len(data) // INDEX_ENTRY_BYTES):
        entry = data[slot * INDEX_ENTRY_BYTES:(slot + 1) * INDEX_ENTRY_BYTES]
        if is_blank(entry):
            continue
        present = sizes.get(slot // per_file, 0) >= (slot % per_file + 1) * stride
        entries.append((slot, valid_header(entry, digest, layout) if present else None))
    return entries
