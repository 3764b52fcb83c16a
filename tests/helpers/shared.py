"""Many stores on one directory: a store's config as one writer of it, and a bounded wait for
what another writer did to show."""

import time

from tests.helpers.store import config


def shared(path, name, **extra):
    return config(path, **{"instance_id": name, "share_refresh": "50ms", "share_writers": 4,
                           **extra})


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.02)
