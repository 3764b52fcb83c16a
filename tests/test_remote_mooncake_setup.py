"""Setting up a Mooncake Store client, without Mooncake: one set-up at a time, and the
callers that waited on one that failed find the tier out of service instead of each trying
again (a hung master would otherwise cost the k-th caller k set-ups)."""

import socket
import threading
import time

import numpy as np

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote import mooncake_tier

NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)


class FailingStore:
    """A client whose set-up takes a while, then fails (a master that hangs, then errs)."""

    setups = 0

    def setup(self, *args) -> int:
        FailingStore.setups += 1
        time.sleep(0.5)
        return -1

    def close(self) -> None:
        pass


class FakeModule:
    MooncakeDistributedStore = FailingStore


def test_callers_that_waited_on_a_failed_setup_do_not_set_it_up_again(monkeypatch):
    monkeypatch.setattr(mooncake_tier, "client_module", lambda: FakeModule)
    with socket.socket() as master:  # takes connections: the port probe passes
        master.bind(("127.0.0.1", 0))
        master.listen(16)
        url = f"mooncake://127.0.0.1:{master.getsockname()[1]}?host=127.0.0.1"
        tier = mooncake_tier.MooncakeTier(url, NS, 4096, timeout_s=1.0, retry_s=60, environ={})
        answers: list[IOStatus] = []

        def call(i: int) -> None:
            (result,) = tier.put_many([(ChunkKey(bytes([i]) * 16), np.zeros(4096, np.uint8))])
            answers.append(result.status)

        callers = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=30)
    assert len(answers) == 6 and not any(a is IOStatus.OK for a in answers)
    assert FailingStore.setups == 1 and tier.failures == 1
    tier.close()
