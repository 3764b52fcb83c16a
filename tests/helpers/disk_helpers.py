"""Shared helpers for the disk-tier tests: small tiers, chunk bytes, fault injection."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import multiprocessing
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.keys import ChunkKey, Namespace

RAW = 8192 + 512  # not a page multiple: exercises padding
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=16)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def chunk(i: int, raw: int = RAW) -> AlignedBuffer:
    """An aligned buffer whose first ``raw`` bytes are a pure function of ``i``."""
    buffer = AlignedBuffer(raw, pin=False)
    rng = np.random.default_rng(i)
    buffer.array[:raw] = rng.integers(0, 256, size=raw, dtype=np.uint8)
    return buffer


def make_tier(paths, slots_per_path=8, **kwargs) -> DiskTier:
    stride = 4096 + -(-RAW // 4096) * 4096
    return DiskTier([str(p) for p in paths], NS, RAW, slots_per_path * len(paths) * stride, **kwargs)


def slot_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/writers/*/slots-*.kvt"))


@contextlib.contextmanager
def failing_io(monkeypatch, match: str, err: int = errno.EIO, calls=("preadv", "pwritev")):
    """Make ``os.preadv``/``os.pwritev`` fail with ``err`` on files whose path contains
    ``match`` (the fault stays inside that path; other paths keep working)."""
    real = {name: getattr(os, name) for name in calls}

    def wrap(name):
        def call(fd, *args):
            if match in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(err, os.strerror(err))
            return real[name](fd, *args)
        return call

    for name in calls:
        monkeypatch.setattr(os, name, wrap(name))
    yield
    for name in calls:
        monkeypatch.setattr(os, name, real[name])


def delayed_io(monkeypatch, name: str, seconds: float | None = None) -> threading.Event:
    """Make ``os.<name>`` (``preadv``/``pwritev``) on slot files wait first: ``seconds``, or,
    with None, until the returned event is set (30 s at most), as on a hung drive."""
    real = getattr(os, name)
    release = threading.Event()

    def call(fd, *args):
        if "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
            if seconds is None:
                release.wait(30)
            else:
                time.sleep(seconds)
        return real(fd, *args)

    monkeypatch.setattr(os, name, call)
    return release


def wait_until(condition, what: str, seconds: float = 10.0) -> None:
    """Poll ``condition()`` until it holds; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@contextlib.contextmanager
def small_filesystem(size: str):
    """A fresh tmpfs of ``size`` mounted on a temp dir (root only; skips elsewhere)."""
    where = tempfile.mkdtemp(prefix="kvtier-fs-")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", where],
                            capture_output=True, text=True)
    if result.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield Path(where)
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


@contextlib.contextmanager
def lock_held_elsewhere(segment: Path):
    """The segment's lock held by another process of this machine (an engine's worker)."""
    holding, release = multiprocessing.Event(), multiprocessing.Event()

    def worker() -> None:
        fd = os.open(segment / "lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        holding.set()
        release.wait(30)

    process = multiprocessing.get_context("fork").Process(target=worker)
    process.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        release.set()
        process.join(10)
