"""A load's chunks are copied into the engine's pages as their reads land, and never after
the load is over (a read given up on that ends later must not write into blocks vLLM has
since recomputed)."""

import threading

from kvtier.connector.early_scatter import EarlyScatter
from kvtier.connector.messages import ChunkLoad, ChunkStore, DiskWrite, RequestLoad, StepPlan
from tests.disk_helpers import wait_until
from tests.test_connector_worker import LAYERS, same, worker_and_engine


def stored(tmp_path, **config):
    """A worker whose disk holds chunks ``a`` (blocks 2-3) and ``b`` (blocks 4-5)."""
    side, kv, engine = worker_and_engine(tmp_path, **config)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), 1, disk_slot=0),
                               ChunkStore(b"b" * 16, (4, 5), 2, disk_slot=1)]))
    side.drain()
    side.report()
    return side, kv, engine, [t.clone() for t in kv]


def test_chunks_are_in_the_pages_once_their_reads_are_over(tmp_path, monkeypatch):
    side, kv, _, original = stored(tmp_path)
    copied_on = []
    scatter = side.pages.scatter
    monkeypatch.setattr(side.pages, "scatter", lambda *a: (copied_on.append(
        threading.current_thread().name), scatter(*a))[1])
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=3, disk_slot=0),
                             ChunkLoad(b"b" * 16, (12, 13), 0, host_slot=4, disk_slot=1)),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    side.drain()  # the reads are over; the engine's thread has not looked yet
    assert all(same(kv[i][10:14], original[i][2:6]) for i in range(LAYERS))
    assert side.finished() == {"r"} and side.take_invalid_blocks() == set()
    assert len(copied_on) == 2 and threading.main_thread().name not in copied_on  # not twice
    side.close()


def test_a_read_given_up_on_never_writes_into_the_pages(tmp_path):
    side, kv, engine, _ = stored(tmp_path, load_timeout=0.2)
    engine.hold()  # a drive that does not answer
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=3, disk_slot=0),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    wait_until(lambda: side.finished() == {"r"}, "a hung read held the request")
    assert side.take_invalid_blocks() == {10, 11}
    for t in kv:  # vLLM recomputes the blocks (and may give them to another request)
        t[10:12].fill_(7.0)
    recomputed = [t.clone() for t in kv]
    engine.release()  # the read ends now, verified and good
    side.drain()
    side.finished()
    assert side.report().reads_over[b"a" * 16] == 1
    assert all(same(kv[i], recomputed[i]) for i in range(LAYERS))
    side.close()


def test_a_load_behind_its_write_back_lands_early_too(tmp_path):
    side, kv, _, original = stored(tmp_path)
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=3, disk_slot=0),),
                       demotions=(DiskWrite(b"b" * 16, host_slot=2, disk_slot=5),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    wait_until(lambda: all(same(kv[i][10:12], original[i][2:4]) for i in range(LAYERS)),
               "the chunk never reached its pages")
    wait_until(lambda: side.finished() == {"r"}, "the load was never reported finished")
    assert side.take_invalid_blocks() == set()
    side.close()


def test_close_waits_for_a_copy_in_progress_and_refuses_later_ones():
    entered, finish = threading.Event(), threading.Event()
    copies = []

    def copy(key):
        entered.set()
        finish.wait(5)
        copies.append(key)

    gate = EarlyScatter(copy)
    first = threading.Thread(target=gate.land, args=(b"a",))
    first.start()
    entered.wait(5)
    closed = []
    closer = threading.Thread(target=lambda: closed.append(gate.close()))
    closer.start()
    closer.join(0.1)
    assert closer.is_alive()  # held until the copy in progress is over
    finish.set()
    closer.join(5)
    first.join(5)
    assert closed == [{b"a"}]
    gate.land(b"b")
    assert copies == [b"a"]  # nothing copied after close


def test_a_copy_that_fails_is_left_to_the_engine_thread(caplog):
    def copy(key):
        raise RuntimeError("pages gone")

    gate = EarlyScatter(copy)
    gate.land(b"a")
    assert gate.close() == set()
    assert any("early" in r.getMessage() for r in caplog.records)


def test_a_failed_early_copy_is_done_again_by_the_engine(tmp_path, monkeypatch):
    side, kv, _, original = stored(tmp_path)
    scatter, calls = side.pages.scatter, []

    def first_fails(*args):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("transient")
        scatter(*args)

    monkeypatch.setattr(side.pages, "scatter", first_fails)
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=3, disk_slot=0),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    side.drain()
    assert side.finished() == {"r"} and side.take_invalid_blocks() == set()
    assert calls[-1] == threading.main_thread().name
    assert all(same(kv[i][10:12], original[i][2:4]) for i in range(LAYERS))
    side.close()
