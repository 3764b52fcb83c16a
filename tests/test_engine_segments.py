"""The scheduler side's view of its engine's own segments (``EngineSegments``): until its
workers' segment is found, each refresh looks each default writer id up once on each disk
path (by name, ``SafeDir.subdir``), and answers the first default id while no process of this
host holds it; once found, the id is kept and nothing is looked up."""

import os
from collections import Counter

from kvtier import KVStore
from kvtier.config.settings import load_config
from kvtier.connector.common.engine_writer import EngineSegments
from kvtier.io.safefs import SafeDir
from kvtier.segment.names import default_writer_ids, host_name, writer_ids
from tests.helpers.kv import CHUNK, SMALL
from tests.helpers.store import config


def counted_lookups(monkeypatch) -> Counter[str]:
    """Each default writer id's lookups from now on (``SafeDir.subdir`` of its name)."""
    ids, seen = set(default_writer_ids(host_name())), Counter[str]()
    subdir = SafeDir.subdir

    def counted(self, name, **kwargs):
        if name in ids:
            seen[name] += 1
        return subdir(self, name, **kwargs)

    monkeypatch.setattr(SafeDir, "subdir", counted)
    return seen


def test_a_refresh_looks_each_default_id_up_once_per_path_until_its_workers_are_found(
        tmp_path, monkeypatch):
    roots = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    for root in roots:
        os.mkdir(root, 0o700)
    first = writer_ids(None)[0]
    stores = config(roots[0], disk_paths=roots, share_writers=4, share_refresh="1h")
    with KVStore(SMALL, {**stores, "instance_id": "another"}) as other:
        namespace = other.namespace  # its writers/ on both paths, none of this host's ids
    segments = EngineSegments(load_config({"disk_paths": roots, "chunk_tokens": CHUNK},
                                          environ={}), [namespace])
    seen = counted_lookups(monkeypatch)
    for _ in range(2):  # not found: looked for again at each refresh
        seen.clear()
        assert segments() == [(first, first)]  # held by no process: the workers' to take
        assert seen[first] == len(roots) and max(seen.values()) == len(roots)
    with KVStore(SMALL, {**stores, "instance_id": first}):  # a worker of this process
        seen.clear()
        assert segments() == [(first, first)]
        assert seen[first] == len(roots) and max(seen.values()) == len(roots)
        seen.clear()
        assert segments() == [(first, first)] and not seen  # found: kept, nothing looked up
