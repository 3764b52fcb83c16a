"""Helpers for the hostile-cache-directory tests: a real namespace (one writer's segment) to
damage, a decoy tree outside the root whose every byte must survive, the CLI run
in-process with a time bound, and a stopped writer's namespace with seat files to plant."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import stat
import time
from pathlib import Path

from typer.testing import CliRunner

from kvtier import KVStore
from kvtier.cli.main import app
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.shared import shared
from tests.helpers.store import config, seq

EXIT_CODES = {0, 1, 2}  # docs/cli.md: ok, a problem found (or left alone), could not run


def make_cache(root: Path, chunks: int = 3, **extra: object) -> Path:
    """``root`` holding one namespace of ``chunks`` chunks written by one store (``extra``:
    more of its config, such as ``instance_id``); returns its segment directory,
    ``<root>/<namespace id>/writers/<writer id>``."""
    root.mkdir(mode=0o700, exist_ok=True)
    with KVStore(SMALL, config(root, **{"share_writers": 4, **extra})) as store:
        store.put(seq(0, chunks), make_kv(seq(0, chunks)))
        assert store.flush()
        return root / store.namespace.id / "writers" / store.disk.writer


def segment_dir(root: Path) -> Path:
    """The only writer's segment under ``root``."""
    (segment,) = root.glob("*/writers/*")
    return segment


def namespace_of(segment: Path) -> Path:
    """The namespace directory a segment belongs to."""
    return segment.parent.parent


def label(segment: Path) -> str:
    """How the CLI's reports name a segment: ``<namespace id>/writers/<writer id>``."""
    return f"{namespace_of(segment).name}/writers/{segment.name}"


def make_decoy(path: Path) -> Path:
    """Files and a directory outside any cache root, for links to point at."""
    (path / "dir").mkdir(parents=True)
    (path / "precious.txt").write_bytes(b"user data, not kvtier's\n" * 100)
    (path / "dir" / "slots-0000.kvt").write_bytes(b"also precious")
    (path / "dir" / "namespace.json").write_text("{}")
    os.chmod(path / "precious.txt", 0o644)
    return path


def tree_digest(path: Path) -> str:
    """Names, kinds, modes, sizes and contents of everything under ``path`` (no link followed)."""
    digest = hashlib.sha256()
    for entry in sorted(path.rglob("*")):
        info = entry.lstat()
        digest.update(f"{entry.relative_to(path)} {info.st_mode:o} {info.st_size}".encode())
        if stat.S_ISREG(info.st_mode):
            digest.update(entry.read_bytes())
        elif stat.S_ISLNK(info.st_mode):
            digest.update(os.readlink(entry).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def time_bound(seconds: int, what: str):
    """Fail (rather than hang the suite) when the body runs longer than ``seconds``."""
    def expired(*_):
        raise TimeoutError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli(*args: object, bound: int = 30):
    """``kvtier ARGS`` in this process: (exit code, output). Fails on an exception that
    escaped, an undocumented exit code, a traceback or a call that runs past ``bound``."""
    with time_bound(bound, f"kvtier {' '.join(map(str, args))}"):
        result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"kvtier {args} raised {result.exception!r}") from result.exception
    assert result.exit_code in EXIT_CODES, (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def stopped_writer_namespace(tmp_path):
    """The namespace directory of one writer "x" that was stopped, its segment and seat gone."""
    with KVStore(SMALL, shared(tmp_path, "x", share_writers=1)):
        pass
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    shutil.rmtree(ns / "writers")
    (ns / "seats" / "seat-0000").unlink()
    return ns


def seat_file(ns, content: bytes, age_s: float = 0.0, name="seat-0000"):
    path = ns / "seats" / name
    path.write_bytes(content)
    os.chmod(path, 0o600)
    if age_s:
        past = time.time() - age_s
        os.utime(path, (past, past))
    return path
