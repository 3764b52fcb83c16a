"""A file system mounted in a shared cache directory (FUSE lets a co-writer mount one on a
directory they own): every look at a mount point goes to that file system, and a FUSE
server that stops answering holds the caller for ever. The shared view's listing of other
writers passes mount points over without looking at them (``kvtier/io/mounts.py``), found in
the mount table. Run in a private mount namespace (``unshare -m``) with tmpfs mounts standing
for the hostile ones."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.io.mounts import is_mounted, mount_points

ROOT = Path(__file__).resolve().parents[1]
LISTING = """
import json, os, subprocess, sys
from kvtier.shared.listing import WriterListing
root, mounts = sys.argv[1], json.loads(sys.argv[2])
for where in mounts:
    if os.path.isfile(where):  # a file of a segment: another file mounted over it
        subprocess.run(["mount", "--bind", "/proc/self/cmdline", where], check=True)
        continue
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", where], check=True)
    os.makedirs(os.path.join(where, "w-inside"), exist_ok=True)
    open(os.path.join(where, "lease"), "w").close()
print(json.dumps(WriterListing([root], "ns", 8).names(0, None)))
"""


def listed(tmp_path: Path, mounted: list[str]) -> dict:
    """The other writers a listing of ``tmp_path/ns`` finds, with tmpfs mounted at each of
    ``mounted`` (paths under ``tmp_path``), in a mount namespace of its own."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    run = subprocess.run(["unshare", "-m", "--", sys.executable, "-c", LISTING, str(tmp_path),
                          json.dumps([str(tmp_path / m) for m in mounted])],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    if run.returncode != 0 and ("Operation not permitted" in run.stderr or "mount:" in run.stderr):
        pytest.skip(f"no private mount namespace here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def segment(where: Path) -> None:
    where.mkdir(parents=True, mode=0o700)
    (where / "lease").write_text("")


def test_a_writer_directory_that_is_a_mount_point_is_passed_over(tmp_path):
    writers = tmp_path / "ns" / "writers"
    segment(writers / "a")
    (writers / "b").mkdir(mode=0o700)  # a mount point: a segment's files inside it
    found = listed(tmp_path, ["ns/writers/b"])
    assert list(found) == ["a"]


def test_a_writer_whose_segment_holds_a_mount_point_is_passed_over(tmp_path):
    """A file system mounted on a file of a co-writer's segment (FUSE mounts one on a file
    it owns): a FUSE server that answers an open and never a close would hold each reader's
    I/O thread for good (a review)."""
    writers = tmp_path / "ns" / "writers"
    segment(writers / "a")
    segment(writers / "b")
    (writers / "b" / "slots-0000.kvt").write_bytes(b"")
    found = listed(tmp_path, ["ns/writers/b/slots-0000.kvt"])
    assert list(found) == ["a"]


def test_a_writers_directory_that_is_a_mount_point_is_not_listed(tmp_path):
    (tmp_path / "ns" / "writers").mkdir(parents=True, mode=0o700)
    assert listed(tmp_path, ["ns/writers"]) == {}


def test_the_mount_table_is_read_with_its_escapes(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text("22 1 0:21 / /proc rw - proc proc rw\n"
                     "66 46 0:40 / /srv/cache/ns/writers/a\\040b rw,relatime - fuse x rw\n")
    points = mount_points(str(table))
    assert points == {"/proc", "/srv/cache/ns/writers/a b"}
    assert mount_points(str(tmp_path / "none")) == frozenset()
    import os
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert is_mounted(frozenset({f"{tmp_path}/x"}), fd, "x")
        assert not is_mounted(frozenset({f"{tmp_path}/x"}), fd, "y")
        assert not is_mounted(frozenset(), fd, "x")
    finally:
        os.close(fd)
