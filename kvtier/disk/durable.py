"""Making what a disk tier's paths hold durable: ``KVStore.flush`` syncs each path in
service on the path's own I/O queue once its writes are over, and a clean close syncs them
before each lease says its segment closed (``CacheDir.sync``: the slot files, then the
index; ``kvtier.segment.slot_files.sync_segment`` says why)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait

from kvtier.disk.paths import DiskPaths
from kvtier.io.guarded import start_thread
from kvtier.io.result import IOResult, IOStatus
from kvtier.segment.slot_files import NO_SYNC

log = logging.getLogger("kvtier.disk.tier")  # the disk tier's messages


def sync_path(paths: DiskPaths, index: int) -> IOResult:
    """Blocking (run it on the path's queue): sync path ``index``. OK, or PATH_DOWN: it is
    out of service, or the sync failed and took it out. What the kernel could not write back
    (an I/O error, a full disk or quota at write-back) is lost, and a later sync would not
    say so (Linux marks the pages clean and reports the error once): the path's chunks
    since its last good sync may not be on the disk, and an index synced later would vouch
    for them. So a failed sync takes the path out of service at once (its chunks leave the
    owner's index, a miss from then on), and it comes back empty, as any path that was in
    service does: a later sync vouches only for what was written since. On a filesystem
    that syncs no file (``NO_SYNC``: some FUSE and network filesystems), where nothing was
    lost by it, the sync is IO_ERROR (not synced) and the path stays."""
    path = paths[index]
    directory = path.dir
    if directory is None:
        return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
    try:
        directory.sync()
    except OSError as exc:
        if exc.errno in NO_SYNC and path.dir is directory:
            return IOResult(IOStatus.IO_ERROR, detail=f"{path.root}: cannot sync here: {exc}")
        if path.dir is directory:  # else taken down (and maybe back) meanwhile
            paths.take_down(path, f"a sync failed ({exc}): what it held since its last sync "
                            "may not be on the disk", directory)
        return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason or str(exc))
    path.eio_run = 0
    return IOResult(IOStatus.OK)


def sync_at_close(paths: DiskPaths, within_s: float) -> None:
    """``sync_path`` of every path in service (and not closed yet: a second close), each on
    a thread of its own, before the paths close, waiting ``within_s`` at most: a failure, or
    a sync still under way then (a slow drive, a network filesystem's commit), is logged and
    the close goes on (the chunks written survive a crash of the process all the same; a
    sync under way holds its segment's files open until it ends)."""
    syncs = {}
    for index, path in enumerate(paths.states):
        if path.dir is not None and not path.dir.closed:
            syncs[index] = Future[IOResult]()
            if not start_thread(threading.Thread(target=_run, args=(syncs[index], paths, index),
                                                 daemon=True, name=f"kvtier-sync-{index}")):
                syncs[index].set_result(IOResult(IOStatus.IO_ERROR, detail="no thread to sync it"))
    wait(syncs.values(), within_s)
    for index, sync in syncs.items():
        result = sync.result() if sync.done() else IOResult(IOStatus.TIMED_OUT, detail=(
            f"still syncing after {within_s:g} s"))
        if not result.ok and result.status is not IOStatus.PATH_DOWN:
            log.warning("kvtier disk path %s not synced at close (%s): after a power loss its "
                        "index may be older than its slots", paths[index].root, result.detail)


def _run(sync: Future[IOResult], paths: DiskPaths, index: int) -> None:
    try:
        sync.set_result(sync_path(paths, index))
    except Exception as exc:  # never lost: the close reports it
        sync.set_result(IOResult(IOStatus.IO_ERROR, detail=repr(exc)))
