"""A path of a shared directory whose mount answers its statistics and the open of its top
directory, then holds every call below it (a FUSE daemon whose back end hung): the shared
view's refresh waits for that path's look once, bounded, then passes it over while the look
runs on, and goes on following the writers of the other paths. Before, the refresh thread
stayed held in the listing of that path for good, and the chunks other engines wrote after
it were never found."""

from tests.helpers.hung_mount import fuse_dirs, unshared

SCRIPT = """
import json, sys, time
from kvtier import KVStore
from kvtier.io import answers, bounded_jobs
from tests.helpers.hung_mount import StatfsOnly
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.shared import shared
from tests.helpers.store import exact, seq

answers.MIN_WAIT_S, bounded_jobs.PATH_JOB_MIN_S, bounded_jobs.PATH_JOB_TIMES = 1.0, 2.0, 1
stuck, good = sys.argv[1], sys.argv[2]
mount, out = StatfsOnly(stuck, top=True), {}
cfg = {"disk_paths": [stuck, good], "load_timeout": "1s", "disk_retry": "1h"}
reader = KVStore(SMALL, {**shared(good, "reader"), **cfg})
writer = KVStore(SMALL, {**shared(good, "writer"), **cfg})
tokens = seq(0, 4)
writer.put(tokens, make_kv(tokens))
out["flushed"] = bool(writer.flush(timeout=30))
deadline = time.monotonic() + 30
while time.monotonic() < deadline and reader.lookup(tokens).tokens < len(tokens):
    time.sleep(0.1)
out["found"] = reader.lookup(tokens).tokens
out["served"] = exact(reader, tokens) if out["found"] else 0
out["statfs"] = mount.statfs
mount.release()  # the calls held fail
writer.close()
reader.close()
print(json.dumps(out))
"""


def test_a_path_that_hangs_below_its_top_directory_holds_no_shared_view_for_good(tmp_path):
    good, stuck = fuse_dirs(tmp_path)
    out = unshared(SCRIPT, str(stuck), str(good), timeout=150)
    assert out["flushed"]
    assert out["statfs"] >= 1, "the path never answered its statistics: not the case tested"
    assert out["found"] == out["served"] == 4 * 16, out
