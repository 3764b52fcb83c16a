"""``kvtier verify`` on segments that change while it reads them: a slot file that goes away
is the segment's problem, never a traceback, and a segment in use is judged by what stays
bad, not by a write caught half done."""

import json
import os

from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.io.safefs import SafeDir
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

