"""The ``kvtier`` command: run as a separate process as a user runs it, its ``--json``
reports, its refusals, and cache directories for it to look at (several writers, an old
layout, a segment's log)."""

import json
import os
import subprocess
import sys

from kvtier import KVStore
from kvtier.keys import namespace_id_of
from tests.helpers.hostile import make_cache
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, seq

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def run(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=60)


def kvtier(*args, stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([*KVTIER, *map(str, args)], capture_output=True, text=True,
                          input=stdin, env=env, timeout=120)


def as_json(*args):
    result = kvtier(*args, "--json")
    return result.returncode, json.loads(result.stdout)


def logged_slots(segment):
    """The slots a reader following the segment's log.kvt learns of."""
    from kvtier.io.safefs import SafeDir
    from kvtier.segment.log import LogFollower

    ns = json.loads((segment.parent.parent / "namespace.json").read_text())
    with SafeDir.open(segment) as directory:
        follower = LogFollower(directory, bytes.fromhex(segment.parent.parent.name),
                               ns["raw_bytes"])
        try:
            follower.refresh()
            return set(follower.slots)
        finally:
            follower.close()


def old_layout_namespace(root, version=1):
    """A namespace of format version ``version`` as version 1 laid it out: its files directly
    in the namespace directory."""
    described = json.dumps({"format_version": version, "model": "old"})
    stale = root / namespace_id_of(described)
    stale.mkdir(mode=0o700)
    (stale / "namespace.json").write_text(json.dumps({"namespace": described, "stride": 8192,
                                                      "raw_bytes": 4096, "file_slots": 10}))
    for name in ("slots-0000.kvt", "index.kvt", "lock", ".namespace.json.tmp-123",
                 ".o_direct_probe-77-0123abcd"):
        (stale / name).write_bytes(bytes(8192))
    return stale


def two_writers(root):
    """A namespace written by writers "w-a" (3 chunks) and "w-b" (2 other chunks)."""
    a = make_cache(root, 3, instance_id="w-a")
    with KVStore(SMALL, config(root, instance_id="w-b", share_writers=4)) as store:
        store.put(seq(100, 2), make_kv(seq(100, 2)))
        assert store.flush()
    return a, a.parent / "w-b"


def refused(result, code: int, *words: str) -> None:
    """Exit ``code``, no traceback, one ``kvtier:`` line on stderr naming ``words``."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
