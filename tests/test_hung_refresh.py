"""Closing a store on a shared directory whose mount hangs: a look at the other writers'
segments blocked in the kernel (an NFS hard mount, a stopped FUSE server) does not hold the
close past its timeout; the files that look uses stay open until it ends."""

import threading

from kvtier import KVStore
from kvtier.shared import listing
from tests.helpers.disk_helpers import wait_until
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, seq


def test_a_refresh_stuck_on_a_hung_mount_does_not_hold_close(tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = listing.WriterListing.names

    def names(self, *args, **kwargs):
        entered.set()
        release.wait(30)  # a listing blocked on a hung mount
        return real(self, *args, **kwargs)

    store = KVStore(SMALL, config(tmp_path, instance_id="a", share_writers=2,
                                  share_refresh="20ms"))
    store.put(seq(0, 2), make_kv(seq(0, 2)))
    monkeypatch.setattr(listing.WriterListing, "names", names)
    wait_until(entered.is_set, "no refresh started")
    closing = threading.Thread(target=store.close, kwargs={"timeout": 1.0}, daemon=True)
    closing.start()
    closing.join(20)  # generous: the close itself is bounded by its 1 s
    try:
        assert not closing.is_alive(), "close waited for the stuck refresh"
    finally:
        release.set()
