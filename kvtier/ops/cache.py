"""Finding the namespaces in a cache directory, and their writers' segments, offline.

A cache root is one ``disk_paths`` entry, and everything below it is hostile: entries are
opened through :class:`~kvtier.io.safefs.SafeDir` (no symlink followed, regular files and
directories of this user only, bounded reads). A namespace is a directory named by 32 hex
digits; its ``namespace.json`` is trusted only when the digest of the namespace it describes
is the directory's name and its slot geometry is the one kvtier derives from it. Each writer
of a namespace has a segment, ``writers/<writer id>/``, holding its slot files
(``kvtier.segment.names``); the namespace's geometry applies to every segment. A namespace of
another format version may hold its files directly in the namespace directory.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.io.safefs import CacheDirError, SafeDir, kind_of
from kvtier.keys import FORMAT_VERSION
from kvtier.ops.listing import namespace_names, root_names, segment_names, writer_names
from kvtier.ops.meta import MetaError, NamespaceMeta, parse_meta
from kvtier.segment.cachedir import MAX_META_BYTES
from kvtier.segment.index_file import MAX_SLOTS, open_segment_dir
from kvtier.segment.names import (
    META_FILE,
    NAMESPACE_NAME,
    SEATS_DIR,
    WRITER_ID,
    WRITERS_DIR,
    slot_number,
)

CacheRootError = CacheDirError  # a path the commands must not operate on, and why
__all__ = ["CacheRootError", "MetaError", "NamespaceDir", "NamespaceMeta", "Segment", "cache_root",
           "error_text", "list_writers", "namespaces", "parse_meta", "slot_file_sizes", "slot_files"]


@dataclass(frozen=True)
class NamespaceDir:
    """One namespace directory under ``root``: its trusted metadata, or why there is none
    (``problem``); ``unsafe`` when the directory itself, its metadata file or its ``writers``
    directory breaks the hostile-directory rule (then no command changes anything in it).

    ``writers``: (writer id, problem) of every entry under ``writers/`` named like a writer
    id (a problem when it is not a directory kvtier would use); ``ignored``: the other
    entries there, which are not kvtier's and are left alone; ``proven``: kvtier's by a slot
    header or index entry (``provenance.removal_refusal`` found it so, before a removal)."""

    root: Path
    id: str
    meta: NamespaceMeta | None
    problem: str = ""
    unsafe: bool = False
    has_meta_file: bool = False
    writers: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()
    proven: bool = False

    @property
    def owned(self) -> bool:
        """True when kvtier provably wrote the directory: its ``namespace.json`` is trusted
        (or ``proven``), and nothing in it breaks the hostile-directory rule."""
        return not self.unsafe and (self.meta is not None or self.proven)

    @property
    def path(self) -> Path:
        return self.root / self.id

    @property
    def namespace(self) -> dict:
        return self.meta.namespace if self.meta else {}

    @property
    def status(self) -> str:
        """ok | stale (an older format version) | newer (a later one: a newer kvtier's,
        never removed by this one) | damaged (namespace.json not trusted) | orphaned (no
        namespace.json) | unsafe."""
        if self.unsafe:
            return "unsafe"
        if self.meta is None:
            return "damaged" if self.has_meta_file else "orphaned"
        version = self.meta.format_version
        return "ok" if version == FORMAT_VERSION else "stale" if version < FORMAT_VERSION else "newer"

    @property
    def readable(self) -> bool:
        """True when its segments' slots can be read with its metadata's geometry."""
        return self.status == "ok"

    @property
    def readable_meta(self) -> NamespaceMeta:
        """``meta`` of a ``readable`` directory (code that reads slots runs only on those)."""
        assert self.meta is not None, f"namespace {self.id} has no trusted namespace.json"
        return self.meta

    @property
    def segments(self) -> list[Segment]:
        """Its writers' segments (none when the namespace itself is unsafe)."""
        return [] if self.unsafe else [Segment(self, name, problem) for name, problem in self.writers]

    def open(self) -> SafeDir:
        with SafeDir.open(self.root) as top:
            return top.subdir(self.id)


@dataclass(frozen=True)
class Segment:
    """One writer's segment of a namespace: ``<namespace>/writers/<writer>/``; ``problem``
    when it is not a directory kvtier would use (then nothing in it is read or changed)."""

    ns: NamespaceDir
    writer: str
    problem: str = ""

    @property
    def unsafe(self) -> bool:
        return bool(self.problem)

    @property
    def label(self) -> str:
        """Its path under the cache root, as reports name it."""
        return f"{self.ns.id}/{WRITERS_DIR}/{self.writer}"

    @property
    def path(self) -> Path:
        return self.ns.root / self.label

    @property
    def meta(self) -> NamespaceMeta:
        return self.ns.readable_meta

    @property
    def digest(self) -> bytes:
        return bytes.fromhex(self.ns.id)

    def open(self) -> SafeDir:
        return open_segment_dir(str(self.ns.root), self.ns.id, self.writer)


def error_text(exc: OSError, where: str = "") -> str:
    """One line saying what failed: the error's message with the entry it names (``where``
    when the error names none, or only a descriptor)."""
    text = exc.strerror or str(exc)
    name = exc.filename if isinstance(exc.filename, str) else where
    return f"{name}: {text}" if name and name not in text else text


def halt_unknown(error: OSError, where: str) -> str:
    """The problem of a ``halt.json`` whose halt cannot be told (``HaltFile.stands``)."""
    return f"halt.json cannot be told: {error_text(error, where)}; remove it by hand"


def cache_root(path: str | Path) -> Path:
    """``path`` checked to be a real directory of this user; raises ``CacheRootError``."""
    try:
        with SafeDir.open(path):
            return Path(path)
    except CacheDirError as exc:
        if exc.errno != errno.ENOTDIR:
            raise
        try:  # O_NOFOLLOW on a symlink says ENOTDIR: name what the entry is
            info = os.lstat(path)
        except OSError:
            raise exc from None
        if stat.S_ISLNK(info.st_mode):
            raise CacheRootError(errno.ELOOP, f"{path} is a symlink; kvtier never follows one: "
                                 "name the real directory, or remove the link") from None
        raise CacheRootError(errno.ENOTDIR, f"{path} is {kind_of(info.st_mode)}, not a "
                             "directory") from None


def namespaces(root: Path, only: str | None = None) -> list[NamespaceDir]:
    """The namespace directories directly under ``root`` (other entries are not kvtier's);
    with ``only`` (a namespace id), that one alone, looked up by its name: the root is not
    listed. ``UnsafeEntry`` (E2BIG) when the root holds more entries than ``ROOT_LISTED``."""
    found: list[NamespaceDir] = []
    with SafeDir.open(root) as top:
        for name in root_names(top) if only is None else [only]:
            info = top.lstat(name) if NAMESPACE_NAME.fullmatch(name) else None
            if info is None:
                continue
            if not stat.S_ISDIR(info.st_mode):  # an engine takes the path out of service
                found.append(NamespaceDir(root, name, None, f"{root / name} is "
                                          f"{kind_of(info.st_mode)}, not a directory: an "
                                          "engine takes this disk path out of service",
                                          unsafe=True))
                continue
            try:
                with top.subdir(name) as directory:
                    described = _describe(root, name, directory)
            except OSError as exc:
                described = NamespaceDir(root, name, None, error_text(exc, str(root / name)),
                                         unsafe=True)
            if described is not None:
                found.append(described)
    return found


def _describe(root: Path, name: str, directory: SafeDir) -> NamespaceDir | None:
    """What the namespace directory ``name`` is, or None when nothing in it is kvtier's;
    it is listed (``namespace_names``) only when it holds neither a ``namespace.json`` nor
    ``writers/``, to find the slot files of format version 1."""
    has_meta = directory.lstat(META_FILE) is not None
    has_writers = directory.lstat(WRITERS_DIR) is not None
    if not has_meta and not has_writers and not any(
            slot_number(n) is not None for n in namespace_names(directory)):
        return None
    seats = directory.lstat(SEATS_DIR)
    if seats is not None and not stat.S_ISDIR(seats.st_mode):
        return NamespaceDir(root, name, None, f"{directory.path}/{SEATS_DIR} is "
                            f"{kind_of(seats.st_mode)}, not a directory: an engine takes "
                            "this disk path out of service", unsafe=True, has_meta_file=has_meta)
    try:
        writers, ignored = list_writers(directory) if has_writers else ((), ())
        data = directory.read_file(META_FILE, MAX_META_BYTES)
    except OSError as exc:
        return NamespaceDir(root, name, None, error_text(exc, directory.path), unsafe=True,
                            has_meta_file=has_meta)
    if data is None:
        return NamespaceDir(root, name, None, "no namespace.json", writers=writers,
                            ignored=ignored)
    try:
        meta, problem = parse_meta(data, name), ""
    except MetaError as exc:
        meta, problem = None, f"namespace.json: {exc}"
    return NamespaceDir(root, name, meta, problem, has_meta_file=True, writers=writers,
                        ignored=ignored)


def list_writers(directory: SafeDir) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(writer id, problem) of each entry of the namespace's ``writers/`` named like a writer
    id, and the names of the others; ``UnsafeEntry`` when ``writers`` itself is unsafe, or
    holds more entries than ``WRITERS_LISTED``."""
    writers, ignored = [], []
    with directory.subdir(WRITERS_DIR) as handle:
        for name in writer_names(handle):
            if not WRITER_ID.fullmatch(name):
                ignored.append(name)
                continue
            info = handle.lstat(name)
            if info is None:
                continue  # gone since it was listed
            problem = ""
            if not stat.S_ISDIR(info.st_mode):
                problem = f"{handle.path}/{name} is {kind_of(info.st_mode)}, not a directory"
            else:
                try:
                    handle.subdir(name).close()
                except OSError as exc:
                    problem = error_text(exc, f"{handle.path}/{name}")
            writers.append((name, problem))
    return tuple(writers), tuple(ignored)


def slot_files(directory: SafeDir, names: list[str] | None = None) -> dict[int, str]:
    """Slot file names by number (only names kvtier writes) among ``names``, by default the
    segment's listing (``segment_names``: ``UnsafeEntry`` past its bound)."""
    files = {}
    for name in segment_names(directory) if names is None else names:
        number = slot_number(name)
        if number is not None:
            files[number] = name  # one name per number: the one kvtier writes
    return dict(sorted(files.items()))


def slot_file_sizes(meta: NamespaceMeta, directory: SafeDir,
                    names: dict[int, str] | None = None) -> dict[int, int]:
    """Bytes of each slot file of a segment (those of ``names``, a ``slot_files`` listing the
    caller goes on using, when given), as far as slots can be (a file is never longer than its
    ``file_slots`` slots); ``UnsafeEntry`` when one is not a regular file of this user."""
    limit = meta.stride * meta.file_slots
    sizes = {}
    for number, name in (slot_files(directory) if names is None else names).items():
        if number * meta.file_slots >= MAX_SLOTS:
            continue  # past any capacity kvtier keeps: not its file
        fd = directory.open_file(name, os.O_RDONLY)
        try:
            sizes[number] = min(os.fstat(fd).st_size, limit)
        finally:
            os.close(fd)
    return sizes
