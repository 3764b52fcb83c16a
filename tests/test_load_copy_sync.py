"""A load whose copy into vLLM's pages fails part-way waits for the copies queued before the
failure before it is reported over: on CUDA they run on a stream of their own, and vLLM may
give the blocks to another request as soon as it hears the load ended."""

from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
from tests.helpers.worker_side import worker


def test_a_copy_that_fails_part_way_waits_for_those_queued_before_it(tmp_path):
    side, _ = worker(tmp_path, disk=False)
    try:
        side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (1, 2), host_slot=0),
                                   ChunkStore(b"b" * 16, (3, 4), host_slot=1)]))
        side.report()
        calls, pages = [], side.pages
        scatter, synchronize = pages.scatter, pages.synchronize
        pages.scatter = lambda *a, **k: (calls.append("scatter"), scatter(*a, **k))[1]
        pages.synchronize = lambda: (calls.append("synchronize"), synchronize())[1]
        # the first chunk is copied; the second was staged but never read: the copy raises
        load = RequestLoad("r", (ChunkLoad(b"a" * 16, (8, 9), 0, host_slot=0),
                                 ChunkLoad(b"b" * 16, (10, 11), 0, host_slot=1, disk_slot=3)),
                           asynchronous=True)
        side._complete(load, {}, 0.0)  # what a ready asynchronous load runs
        assert calls == ["scatter", "synchronize"]
        assert "r" in side._ledger.take_finished()
        assert {8, 9, 10, 11} <= set(side.take_invalid_blocks())  # all recomputed
    finally:
        side.close()
