"""A disk path whose file system stopped answering (a hung NFS or NVMe-oF mount, a stopped
FUSE daemon) holds every call on it for ever. The store, and so the engine, starts without
it: its file system is asked for its statistics on a thread of its own and given
``load_timeout`` to answer (``kvtier/io/answers.py``); the path starts out of service, the
others serve, the shared view's first look is not held either; the hung mount taken away
(unmounted lazily), the path is not reopened on the directory beneath it, and once a file
system is mounted there again the path comes back at its next try. Run in a private mount namespace (``unshare
-m``) on a FUSE mount whose daemon never answers (``tests/helpers/hung_mount.py``), for
the store alone and for the vLLM connector's scheduler side, which looks at the paths too
(a real engine on a hung mount: the same, about 95 s of CI for one engine, so not here)."""


import pytest

from tests.helpers.hung_mount import fuse_dirs, unshared

SCRIPT = """
import json, os, sys, threading, time
from tests.helpers.hung_mount import hang, mount_again, release
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, exact, seq
from kvtier import KVStore
from kvtier.io.answers import outstanding

good, hung = sys.argv[1], sys.argv[2]
device = hang(hung)
made = []
cfg = config(good, disk_chunks=32, load_timeout="1s", disk_retry="0.2s", share_refresh="0.2s")
cfg["disk_paths"] = [good, hung]
start = threading.Thread(target=lambda: made.append(KVStore(SMALL, cfg)), daemon=True)
start.start()
start.join(60)
out = {"started": bool(made)}
if made:
    store = made[0]
    out["down_at_start"] = sorted(store.stats().paths_down)
    tokens = seq(0, 8)
    store.put(tokens, make_kv(tokens))
    store.flush(timeout=30)
    out["served"] = exact(store, tokens)
    out["written"] = store.stats().disk_writes
    time.sleep(1)  # tries of the hung path meanwhile fail at once, holding nothing
    out["down_while_hung"] = sorted(store.stats().paths_down)
    out["questions"] = outstanding(hung)  # (the good path's own, asked each look, may be under way)
    release(hung, device)  # the hung mount taken away, nothing mounted there yet
    path, deadline = store.disk.paths[1], time.monotonic() + 20
    while "is gone" not in path.down_reason and time.monotonic() < deadline:
        path.retry_at = 0.0  # tried at once, again and again: never reopened beneath it
        store.put(seq(1000, 1), make_kv(seq(1000, 1)))
        time.sleep(0.1)
    out["down_unmounted"] = path.down_reason if path.dir is None else ""
    mount_again(hung)
    deadline = time.monotonic() + 30
    while store.stats().paths_down and time.monotonic() < deadline:
        store.put(seq(1000, 1), make_kv(seq(1000, 1)))  # a store's call polls the tries
        time.sleep(0.1)
    out["down_after"] = sorted(store.stats().paths_down)
    store.close()
else:
    release(hung, device)
print(json.dumps(out))
"""



ASK_AGAIN = """
import ctypes, json, os, sys, time
from kvtier.io import answers
from tests.helpers.hung_mount import MNT_DETACH, hang
hung = sys.argv[1]
answers.MIN_WAIT_S, answers.REASK_S = 0.2, 0.0
device = hang(hung)
out = {"hung": [answers.answers(hung, 0.2) for _ in range(answers.MAX_HELD + 1)]}
out["held_before"] = answers.outstanding()  # as many as a path and mount may hold
ctypes.CDLL(None).umount2(os.fsencode(hung), MNT_DETACH)  # the old questions stay hung
out["at_once"], out["held"] = answers.answers(hung, 0.2), answers.outstanding()
os.close(device)
print(json.dumps(out))
"""


def test_a_mount_taken_away_and_made_anew_answers_a_question_asked_again(mounted):
    """An NFS server gone for good: the operator unmounts lazily (the old questions stay
    hung for ever) and mounts a new one there. A question held ``REASK_S`` is asked again
    beside it, up to ``MAX_HELD``; once the mount under the path is another (a new mount ID),
    the path is asked afresh at once, the threads the hung one holds notwithstanding."""
    _, hung = mounted
    out = unshared(ASK_AGAIN, str(hung), timeout=60)
    assert out == {"hung": [False] * 4, "held_before": 3, "at_once": True, "held": 3}


ASK_TOGETHER = """
import json, os, sys
from kvtier.io import answers
from tests.helpers.hung_mount import hang, release
paths = sys.argv[1:]
devices = [hang(path) for path in paths]
answers.ask(paths, 0.2)
out = {"asked": answers.outstanding()}
answers.ask(paths, 0.2)  # asked already: no thread more
out["again"] = answers.outstanding()
out["answered"] = [answers.answers(path, 0.2) for path in paths]
for path, device in zip(paths, devices):
    release(path, device)
print(json.dumps(out))
"""


def test_hung_paths_are_asked_together(mounted, tmp_path):
    """Two hung paths at start cost one wait, not two: both are asked before either is
    waited for, and asking again starts no other thread."""
    _, hung = mounted
    other = tmp_path / "hung-too"
    other.mkdir(mode=0o700)
    out = unshared(ASK_TOGETHER, str(hung), str(other), timeout=60)
    assert out == {"asked": 2, "again": 2, "answered": [False, False]}


@pytest.fixture
def mounted(tmp_path):
    return fuse_dirs(tmp_path)


def test_the_store_starts_without_a_path_whose_mount_hangs_and_takes_it_back_once_mounted_again(mounted):
    good, hung = mounted
    out = unshared(SCRIPT, str(good), str(hung), timeout=180)
    assert out["started"], "the store's start was held by the hung mount"
    assert out["down_at_start"] == [str(hung)] and out["down_while_hung"] == [str(hung)]
    assert out["served"] == 8 * 16 and out["written"] > 0
    assert out["questions"] == 1, "each try of the hung path left a question behind"
    assert "is gone" in out["down_unmounted"], "reopened on the directory beneath the mount"
    assert out["down_after"] == [], "the path did not come back once mounted again"



SCHEDULER = """
import json, sys, threading
from kvtier.config.settings import load_config
from kvtier.connector.scheduler.side import SchedulerSide
from tests.helpers.hung_mount import hang, release
from tests.helpers.scheduler_side import GEO
hung, good = sys.argv[1], sys.argv[2]
device = hang(hung)
cfg = {"chunk_tokens": 32, "host_capacity": 4 * GEO.chunk_bytes, "disk_paths": [hung, good],
       "disk_capacity": 16 * (4096 + GEO.chunk_bytes), "load_timeout": "1s"}
made = []
start = threading.Thread(target=lambda: made.append(SchedulerSide(
    load_config(cfg, environ={}), GEO, [GEO.namespace("m", "", 1, 0)], 1)), daemon=True)
start.start()
start.join(60)
out = {"started": bool(made)}
if made:
    made[0].close()
release(hung, device)
print(json.dumps(out))
"""


def test_a_vllm_scheduler_side_starts_with_its_first_disk_path_hung(mounted):
    """The vLLM connector's scheduler side looks at the disk paths at start: for its
    workers' writer ids, their index files, other writers' segments, and the verification
    halt file (on the first path). With the first path hung it starts all the same."""
    good, hung = mounted
    out = unshared(SCHEDULER, str(hung), str(good), timeout=120)
    assert out["started"], "the scheduler side's start was held by the hung mount"


STATFS_ONLY = """
import json, sys, threading, time
from kvtier import KVStore
from kvtier.config.settings import load_config
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.io import answers, bounded_jobs
from tests.helpers.hung_mount import StatfsOnly
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.scheduler_side import GEO
from tests.helpers.store import config, exact, seq

answers.MIN_WAIT_S, bounded_jobs.PATH_JOB_MIN_S, bounded_jobs.PATH_JOB_TIMES = 1.0, 2.0, 1
stuck, good, top = sys.argv[1], sys.argv[2], sys.argv[3] == "top"
mount, out = StatfsOnly(stuck, top), {}


def started(name, make):
    made = []
    thread = threading.Thread(target=lambda: made.append(make()), daemon=True)
    thread.start()
    thread.join(60)
    out[name] = bool(made)
    return made[0] if made else None


cfg = {**config(good, disk_chunks=32), "load_timeout": "1s", "disk_retry": "1h",
       "share_refresh": "off", "disk_paths": [stuck, good]}
store = started("store", lambda: KVStore(SMALL, cfg))
if store is not None:
    out["down"] = list(store.stats().paths_down.values())
    tokens = seq(0, 8)
    store.put(tokens, make_kv(tokens))
    store.flush(timeout=30)
    out["served"] = exact(store, tokens)
side = started("scheduler", lambda: SchedulerSide(load_config(
    {"chunk_tokens": 32, "host_capacity": 4 * GEO.chunk_bytes, "disk_paths": [stuck, good],
     "disk_capacity": 16 * (4096 + GEO.chunk_bytes), "load_timeout": "1s",
     "share_refresh": "off", "verify_halt_after": 2}, environ={}),
    GEO, [GEO.namespace("m", "", 1, 0)], 1))
out["statfs"] = mount.statfs
mount.release()  # the calls held fail
for made in (store, side):
    if made is not None:
        made.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize(("answered", "reason"), [
    ("statfs", "did not answer within 1 s"), ("top", "cannot open: no end to it within 2 s")])
def test_a_mount_that_answers_its_statistics_then_holds_every_open_holds_no_start(
        mounted, answered, reason):
    """A FUSE daemon whose back end hung answers ``statfs`` and holds every open: the path
    does not answer (``kvtier.io.answers`` opens its directory too). One that also answers
    the open of its top directory holds whatever looks further: the store starts without
    that path (its open waited for ``path_job_wait``), and so does the vLLM connector's
    scheduler side, which looks there for its workers' writer ids, its index files and the
    halt file (each look bounded)."""
    good, stuck = mounted
    out = unshared(STATFS_ONLY, str(stuck), str(good), answered, timeout=120)
    assert out["store"], "the store's start was held by the open of the stuck path"
    assert len(out["down"]) == 1 and reason in out["down"][0], out["down"]
    assert out["served"] == 8 * 16
    assert out["scheduler"], "the scheduler side's start was held by a look at the stuck path"
    assert out["statfs"] >= 1, "the path never answered its statistics: not the case tested"
