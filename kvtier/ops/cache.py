"""Finding the namespaces in a cache directory and reading what they hold, offline.

A cache root is one ``disk_paths`` entry. Only real directories below it are looked at:
symlinks are never followed, so nothing outside the root is read, changed or removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.io.cachedir import INDEX_FILE, LOCK_FILE, META_FILE, CacheDirError, lock_namespace
from kvtier.io.format import INDEX_ENTRY_BYTES, SlotHeader, is_blank
from kvtier.io.slotindex import SlotLayout, valid_header

CacheRootError = CacheDirError  # a path the commands must not operate on, and why


@dataclass(frozen=True)
class NamespaceDir:
    """One namespace's directory and what its ``namespace.json`` says (None when unreadable)."""

    path: Path
    meta: dict | None

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def namespace(self) -> dict:
        try:
            return json.loads(self.meta["namespace"]) if self.meta else {}
        except (KeyError, TypeError, ValueError):
            return {}

    @property
    def slot_files(self) -> list[Path]:
        return sorted(p for p in self.path.glob("slots-*.kvt") if p.is_file() and not p.is_symlink())

    @property
    def stride(self) -> int | None:
        return self.meta.get("stride") if self.meta else None

    @property
    def file_slots(self) -> int | None:
        return self.meta.get("file_slots") if self.meta else None

    def layout(self) -> SlotLayout | None:
        if not self.meta or "raw_bytes" not in self.meta:
            return None
        capacity = sum(f.stat().st_size for f in self.slot_files) + self.meta["stride"]
        return SlotLayout(self.meta["raw_bytes"], 1, capacity)


def cache_root(path: str | Path) -> Path:
    """``path`` checked to be a real directory (not a symlink); raises ``CacheRootError``."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CacheRootError(errno.ENOENT, f"{path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise CacheRootError(errno.ELOOP, f"{path} is a symlink; name the real cache directory")
    if not stat.S_ISDIR(info.st_mode):
        raise CacheRootError(errno.ENOTDIR, f"{path} is not a directory")
    return path


def namespaces(root: Path) -> list[NamespaceDir]:
    """The namespace directories directly under ``root`` (symlinks skipped)."""
    found = []
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        meta_path = entry / META_FILE
        has_slots = any(entry.glob("slots-*.kvt"))
        if not meta_path.exists() and not has_slots:
            continue
        try:
            meta = json.loads(meta_path.read_text()) if not meta_path.is_symlink() else None
        except (OSError, ValueError):
            meta = None
        found.append(NamespaceDir(entry, meta))
    return found


def in_use(directory: NamespaceDir) -> bool:
    """True when a running kvtier process holds the namespace's lock."""
    lock = directory.path / LOCK_FILE
    if not lock.exists() or lock.is_symlink():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def hold(directory: NamespaceDir) -> int:
    """Take the namespace's lock for an operation that changes it; raise if it is in use."""
    return lock_namespace(directory.path, "stop it first")


def index_entries(directory: NamespaceDir) -> list[tuple[int, SlotHeader | None]]:
    """(slot, header or None when the entry is bad) for every non-blank index entry."""
    path = directory.path / INDEX_FILE
    if not path.exists() or path.is_symlink() or directory.meta is None:
        return []
    data = path.read_bytes()
    digest = bytes.fromhex(directory.id) if len(directory.id) == 32 else b""
    layout = directory.layout()
    entries = []
    for slot in range(len(data) // INDEX_ENTRY_BYTES):
        entry = data[slot * INDEX_ENTRY_BYTES:(slot + 1) * INDEX_ENTRY_BYTES]
        if is_blank(entry):
            continue
        entries.append((slot, valid_header(entry, digest, layout) if layout else None))
    return entries
