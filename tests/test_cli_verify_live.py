"""``kvtier verify`` on segments that change while it reads them: a slot file that goes away
is the segment's problem, never a traceback, and a segment in use is judged by what stays
bad, not by a write caught half done."""

import fcntl
import json
import os

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.io.safefs import SafeDir
from kvtier.ops import recheck
from tests.helpers.hostile import make_cache


def kvtier(*args):
    """``kvtier ARGS`` in this process: (exit code, stdout); no exception escapes."""
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    result = CliRunner().invoke(app, [str(a) for a in args], env=clean)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout


def verified(root):
    """(exit code, the one writer's report) of ``kvtier verify ROOT --json``."""
    code, out = kvtier("verify", root, "--json")
    (writer,) = json.loads(out)["namespaces"][0]["writers"]
    return code, writer


def test_a_slot_file_that_goes_away_while_verify_reads_is_the_segments_problem(tmp_path,
                                                                               monkeypatch):
    segment = make_cache(tmp_path / "c", 2)
    os.close(os.open(segment / "slots-0001.kvt", os.O_CREAT | os.O_WRONLY, 0o600))
    real, opened = SafeDir.open_file, []

    def open_then_unlink(self, name, flags, **kwargs):
        """Its writer trims it away once verify has checked it is a file of this user and
        read its size (its second opening)."""
        fd = real(self, name, flags, **kwargs)
        opened.append(name)
        if opened.count("slots-0001.kvt") == 2 and name == "slots-0001.kvt":
            os.unlink(name, dir_fd=self.fd)
        return fd
    monkeypatch.setattr(SafeDir, "open_file", open_then_unlink)
    code, writer = verified(tmp_path / "c")
    assert code == 1 and "slots-0001.kvt went away while verify read" in writer["problem"]
    monkeypatch.undo()
    assert verified(tmp_path / "c")[0] == 0



ENTRY = 128  # an index entry: the first bytes of its slot's header
PAYLOAD = 4096  # a slot's payload starts after its header


@pytest.fixture
def live(tmp_path):
    """A cache root whose one segment (2 chunks) a running writer holds: its lock taken as a
    writer takes it."""
    segment = make_cache(tmp_path / "c", 2)
    with open(segment / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield segment


def rewrite(path, offset, data):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def during_the_pause(monkeypatch, change=lambda: None):
    """Run ``change`` (what the writer finishes meanwhile) where verify pauses before it
    reads again the slots of a segment in use that looked bad; no real pause."""
    monkeypatch.setattr(recheck, "settle", change)


def test_a_slot_whose_index_entry_is_being_written_is_no_problem_in_a_segment_in_use(
        live, monkeypatch):
    index = live / "index.kvt"
    entry = index.read_bytes()[ENTRY:2 * ENTRY]
    rewrite(index, ENTRY, bytes(ENTRY))  # slot 1 written, its entry not yet
    during_the_pause(monkeypatch, lambda: rewrite(index, ENTRY, entry))
    code, writer = verified(live.parent.parent.parent)
    assert code == 0 and writer["in_use"] and writer["unindexed"] == [] and writer["ok"] == 2
    code, out = kvtier("verify", live.parent.parent.parent)
    assert code == 0 and "(in use)" in out


def test_a_slot_whose_payload_is_being_written_is_counted_as_read_again(live, monkeypatch):
    slots = live / "slots-0000.kvt"
    byte = slots.read_bytes()[PAYLOAD:PAYLOAD + 1]
    rewrite(slots, PAYLOAD, bytes([byte[0] ^ 0x55]))
    during_the_pause(monkeypatch, lambda: rewrite(slots, PAYLOAD, byte))
    code, writer = verified(live.parent.parent.parent)
    assert code == 0 and writer["corrupt"] == [] and writer["ok"] == 2


def test_a_corrupt_slot_in_a_segment_in_use_is_reported(live, monkeypatch):
    slots = live / "slots-0000.kvt"
    rewrite(slots, PAYLOAD, bytes([slots.read_bytes()[PAYLOAD] ^ 0x55]))
    during_the_pause(monkeypatch)
    code, writer = verified(live.parent.parent.parent)
    assert code == 1 and writer["in_use"] and writer["corrupt"] == [0] and writer["ok"] == 1


def test_a_slot_its_index_still_misses_in_a_segment_in_use_is_reported(live, monkeypatch):
    rewrite(live / "index.kvt", ENTRY, bytes(ENTRY))
    during_the_pause(monkeypatch)
    code, writer = verified(live.parent.parent.parent)
    assert code == 1 and writer["in_use"] and writer["unindexed"] == [1]
