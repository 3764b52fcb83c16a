"""With tensor parallelism and no instance_id, every rank of an engine writes under the id
its rank 0 took, even when another engine of the host holds the first id in rank 0's
namespace only (engines that started at the same time)."""

import os
import subprocess
import sys
from pathlib import Path

from kvtier.connector.common.engine_writer import leaders_writer
from kvtier.segment.names import host_name
from tests.helpers.worker_side import GEO

ROOT = Path(__file__).resolve().parents[1]

HOLD = """
import sys, time
from kvtier.disk.tier import DiskTier
from tests.helpers.worker_side import GEO
tier = DiskTier([sys.argv[1]], GEO.namespace("m", "", 2, 0), GEO.chunk_bytes,
                8 * (4096 + GEO.chunk_bytes), writers=[sys.argv[2]], share_writers=4)
print("ready", flush=True)
time.sleep(600)
"""

RANK_1 = """
import sys, torch
from kvtier.config.settings import load_config
from kvtier.connector.worker.side import WorkerSide
from tests.helpers.worker_side import BLOCK, BLOCKS, GEO, HIDDEN, LAYERS
config = load_config({"chunk_tokens": 2 * BLOCK, "host_capacity": 8 * GEO.chunk_bytes,
                      "disk_paths": [sys.argv[1]], "disk_capacity": 8 * (4096 + GEO.chunk_bytes),
                      "disk_min_free": 0, "share_writers": 4}, environ={})
side = WorkerSide(config, GEO, GEO.namespace("m", "", 2, 1), leader=GEO.namespace("m", "", 2, 0))
kv = torch.zeros(LAYERS, BLOCKS, 2, BLOCK, HIDDEN, dtype=torch.bfloat16).unbind(0)
side.register({f"layer{i}": t for i, t in enumerate(kv)})
print(side.disk.writer, flush=True)
side.close()
"""


def hold(root: Path, writer: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root), writer], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    return holder


def test_a_sibling_workers_segment_of_rank_0_is_found(tmp_path):
    ns0 = GEO.namespace("m", "", 2, 0)
    assert leaders_writer((str(tmp_path),), ns0, timeout=0.2, parent=os.getpid()) is None
    holder = hold(tmp_path, f"{host_name()}-5")
    try:  # a child of this process: for a sibling, this process is the parent
        assert leaders_writer((str(tmp_path),), ns0, parent=os.getpid()) == f"{host_name()}-5"
        assert leaders_writer((str(tmp_path),), ns0, timeout=0.2, parent=1) is None  # not ours
    finally:
        holder.kill()
        holder.wait()


def test_rank_1_takes_the_id_rank_0_took_though_a_lower_one_is_free(tmp_path):
    holder = hold(tmp_path, f"{host_name()}-1")  # rank 0: another engine had <host>-0 there
    try:
        rank_1 = subprocess.run([sys.executable, "-c", RANK_1, str(tmp_path)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert rank_1.returncode == 0, rank_1.stderr[-3000:]
        assert rank_1.stdout.split()[-1] == f"{host_name()}-1"  # not <host>-0, free in its namespace
    finally:
        holder.kill()
        holder.wait()


def test_rank_1_waits_for_no_segment_when_no_path_answers(tmp_path, monkeypatch):
    """A hung mount on every path: rank 0 holds no segment there to be found, so rank 1 takes
    the ids in their order at once rather than look for one for LEADER_WAIT_S."""
    from kvtier.config.settings import load_config
    from kvtier.connector.common import engine_writer

    config = load_config({"disk_paths": [str(tmp_path)]}, environ={})
    monkeypatch.setattr(engine_writer, "answers", lambda root, timeout: False)

    def looked(*args, **kwargs):
        raise AssertionError("rank 0's writer looked for under no path that answers")

    monkeypatch.setattr(engine_writer, "leaders_writer", looked)
    ns0, ns1 = GEO.namespace("m", "", 2, 0), GEO.namespace("m", "", 2, 1)
    assert engine_writer.rank_writer_ids(config, ns1, ns0) == engine_writer.writer_ids(None)
