"""A lease names the machine its writer runs on by the kernel's boot id, and its PID namespace,
not by host name alone: machines (or containers) given one host name never take each
other's live segment, nor each other's processes for their own."""

import json
import os
import time
import uuid

from kvtier import KVStore
from kvtier.config.settings import load_config
from kvtier.connector.common.engine_writer import engine_writers
from kvtier.segment import machine
from kvtier.segment.lease import LeaseInfo
from kvtier.segment.lease_age import held_elsewhere
from kvtier.segment.names import default_writer_ids, host_name
from tests.helpers.disk_helpers import NS, lock_held_elsewhere
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq

OTHER_BOOT = str(uuid.UUID(int=uuid.UUID(machine.boot_id()).int ^ 1))  # another kernel's


def lease(**fields) -> bytes:
    """A fresh lease, as a writer of this kernel and PID namespace writes it, with ``fields``."""
    now = time.time_ns()
    return json.dumps({"instance": "w", "host": host_name(), "pid": 4242, "beat": 7,
                       "started_ns": now - 10**9, "written_ns": now, "timeout_ms": 120_000,
                       "boot_id": machine.boot_id(), "pid_ns": machine.pid_namespace(),
                       **fields}).encode()


def elsewhere(**fields) -> bool:
    return bool(held_elsewhere(LeaseInfo.parse(lease(**fields)), 0.0))  # written just now


def test_a_lease_is_of_this_machine_by_its_boot_id_or_else_its_host_name():
    assert machine.boot_id() and machine.pid_namespace()
    assert not elsewhere()  # this kernel: its lock says
    assert elsewhere(boot_id=OTHER_BOOT)  # this host name, another kernel
    assert not elsewhere(host="elsewhere")  # another name, this kernel
    assert not elsewhere(boot_id="") and elsewhere(boot_id="", host="elsewhere")  # by name
    assert LeaseInfo.parse(lease(boot_id=1)) is None
    written = LeaseInfo.parse(lease())
    assert (written.boot_id, written.pid_ns) == (machine.boot_id(), machine.pid_namespace())


def test_a_live_segment_of_another_machine_with_this_host_name_is_not_taken(tmp_path):
    """Two machines of one host name on a filesystem that passes no ``flock`` between them:
    this one sees the other's fresh lease on ``<host>-0`` and no lock held, and writes under
    the next id instead."""
    tokens = seq(0, 2)
    shared = config(tmp_path, share_writers=2)
    with KVStore(SMALL, shared) as first:  # the other machine's earlier run made the segment
        first.put(tokens, make_kv(tokens))
        first.flush()
    first_id = default_writer_ids(host_name())[0]
    (segment,) = tmp_path.glob(f"*/writers/{first_id}")
    theirs = lease(instance=first_id, boot_id=OTHER_BOOT)
    (segment / "lease").write_bytes(theirs)
    with KVStore(SMALL, shared) as second:
        assert second.disk.writer == default_writer_ids(host_name())[1]
        assert not second.stats().paths_down and exact(second, tokens) == 2 * CHUNK  # read
    assert (segment / "lease").read_bytes() == theirs  # left to its writer
    (segment / "lease").write_bytes(lease(instance=first_id, boot_id=""))
    with KVStore(SMALL, shared) as again:  # an older kvtier's lease: this host's, by name
        assert again.disk.writer == first_id


def test_a_held_segment_whose_lease_names_this_pid_in_another_pid_space_is_not_this_engines(tmp_path):
    """Containers of one host name, on one kernel (so one ``flock``) or not: the other's
    worker may have this process's pid in its own PID namespace."""
    root = tmp_path / "cache"
    segment = root / NS.id / "writers" / default_writer_ids(host_name())[0]
    segment.mkdir(parents=True, mode=0o700)
    for directory in (root, root / NS.id, segment.parent):
        os.chmod(directory, 0o700)
    (segment / "lock").touch(mode=0o600)
    cfg = load_config({"disk_paths": [str(root)], "chunk_tokens": CHUNK}, environ={})
    with lock_held_elsewhere(segment):
        for other, mine in (({"pid_ns": machine.pid_namespace() + 1}, None),
                            ({"boot_id": OTHER_BOOT}, None), ({}, segment.name)):
            (segment / "lease").write_bytes(lease(instance=segment.name, pid=os.getpid(), **other))
            assert engine_writers(cfg, [NS]) == [mine], other


def test_a_lease_of_this_hosts_boot_before_this_one_shows_no_live_writer(monkeypatch):
    """A crash, then a reboot: the lease names this host and the previous boot, and was last
    written before this kernel booted (and more than two of its heartbeats ago). Its writer
    went with that kernel: the restarted engine takes its own segment (and cache) back."""
    from kvtier.segment import lease_age

    previous = LeaseInfo.parse(lease(boot_id=OTHER_BOOT))  # beats every 1/6 s (7 in 1 s)
    monkeypatch.setattr(lease_age, "uptime_s", lambda: 30.0)  # booted 30 s ago
    assert not held_elsewhere(previous, 45.0)  # written 45 s ago: before this boot
    assert held_elsewhere(previous, 20.0)  # since this boot: another machine of this name
    assert held_elsewhere(LeaseInfo.parse(lease(boot_id=OTHER_BOOT, host="other")), 45.0)
    monkeypatch.setattr(lease_age, "uptime_s", lambda: None)  # not Linux: cannot be told
    assert held_elsewhere(previous, 45.0)


def test_after_a_reboot_an_engine_with_an_instance_id_serves_its_cache(tmp_path, monkeypatch):
    from kvtier.segment import lease_age

    tokens, cfg = seq(0, 2), config(tmp_path, instance_id="a", lease_timeout="10m")
    with KVStore(SMALL, cfg) as before:
        before.put(tokens, make_kv(tokens))
        before.flush()
    (segment,) = tmp_path.glob("*/writers/a")
    crashed = json.loads((segment / "lease").read_text())
    crashed.update(closed_ns=0, boot_id=OTHER_BOOT)  # killed, then the machine rebooted
    (segment / "lease").write_text(json.dumps(crashed))
    old = time.time() - 90
    os.utime(segment / "lease", (old, old))  # last beat 90 s ago
    monkeypatch.setattr(lease_age, "uptime_s", lambda: 60.0)  # booted 60 s ago
    with KVStore(SMALL, cfg) as after:
        assert not after.stats().paths_down and exact(after, tokens) == 2 * CHUNK
