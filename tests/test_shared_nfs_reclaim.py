"""A reclaim on NFS: a file still open on the deleting host is not deleted but renamed
(``.nfs*``, the client's "silly rename", removed once the last descriptor closes). A reader
that kept a gone writer's log or slot files open would leave such files in the segment, and
the segment, never empty, and its writer's seat would stay for as long as the reader ran."""

import os
import secrets
import threading
import time

from kvtier import KVStore
from kvtier.io import safefs
from kvtier.ops.cache import namespaces
from kvtier.ops.reclaim import gc
from kvtier.tiers.base import TierName
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.shared import shared, wait_for
from tests.helpers.store import config, exact, seq


def held_open(info: os.stat_result, but: int = -1) -> bool:
    """Whether this process holds the file ``info`` describes open (``but`` aside)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            held = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (info.st_dev, info.st_ino) and int(fd) != but:
            return True
    return False


def nfs_like(monkeypatch) -> list[str]:
    """Removals as an NFS client makes them: a file open here is renamed, not deleted, and
    deleted once no descriptor of it is left (looked at every 20 ms). Returns the names
    renamed."""
    renamed: list[str] = []
    silly: list[str] = []
    real = safefs.SafeDir.remove_file

    def remove_file(self, name, links=1):
        info = self.lstat(name)
        if info is not None and held_open(info, but=self.fd):
            new = f".nfs{secrets.token_hex(8)}"
            os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            renamed.append(name)
            silly.append(os.path.join(self.path, new))
            return True
        return real(self, name, links)

    def client() -> None:
        while True:
            for path in list(silly):
                if not held_open(os.stat(path)):
                    os.unlink(path)
                    silly.remove(path)
            time.sleep(0.02)

    monkeypatch.setattr(safefs.SafeDir, "remove_file", remove_file)
    threading.Thread(target=client, daemon=True).start()
    return renamed


def test_a_reader_lets_go_of_a_gone_writers_files_before_it_reclaims_them(tmp_path, monkeypatch):
    renamed = nfs_like(monkeypatch)
    tokens = seq(0, 2)
    quick = {"share_writers": 2, "lease_timeout": "2s"}
    a = KVStore(SMALL, shared(tmp_path, "a", **quick))
    a.put(tokens, make_kv(tokens))
    a.flush()
    with KVStore(SMALL, shared(tmp_path, "b", **quick)) as b:
        assert exact(b, tokens) == 2 * CHUNK  # a's log and slot file are open in b now
        a.close()  # gone: no more heartbeats, its lock let go
        wait_for(lambda: not list(tmp_path.glob("*/writers/a")), timeout=20)
        assert set(renamed) <= {"lock"}, renamed  # (held by the reclaim itself, then closed)
        assert [p.read_text() for p in tmp_path.glob("*/seats/seat-*")] == ["b"]
        wait_for(lambda: b.stats().shared_reclaimed == 1)  # (counted once it is gone)
        assert b.lookup(tokens).chunks_by_tier.get(TierName.SHARED, 0) == 0  # gone with it


def test_gc_gone_removes_on_nfs_the_segment_its_own_lock_kept(tmp_path, monkeypatch):
    """``kvtier gc --gone`` holds the segment's lock as it removes it: on NFS that file is
    only renamed, so the directory stays; the next run finds it empty and removes it."""
    renamed = nfs_like(monkeypatch)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    tokens = seq(0, 2)
    with KVStore(SMALL, config(root, instance_id="a", share_writers=2, share_refresh="off")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    time.sleep(1.2)
    for _ in range(3):
        report = gc(namespaces(root), gone_s=1.0)
        if not list(root.glob("*/writers/a")):
            break
        time.sleep(1.2)  # the client deletes the renamed lock once closed; the directory
        # has changed since: gone that long again
    assert not list(root.glob("*/writers/a")) and not list(root.glob("*/seats/seat-*"))
    assert renamed == ["lock"] and not report.left, report
