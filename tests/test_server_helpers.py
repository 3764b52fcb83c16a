"""The servers tests and benchmarks start never outlive the process that started them: a run
killed outright (SIGKILL, the OOM killer) leaves no redis-server listening."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.redis_server import needs_redis
from tests.helpers.vllm_engine import ROOT

STARTER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.helpers.redis_server import RedisServer
server = RedisServer(Path(sys.argv[2])).start()
print(json.dumps({"pid": server.process.pid, "port": server.port}), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@needs_redis
def test_a_redis_server_dies_with_the_process_that_started_it(tmp_path):
    server = {"pid": 0}
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(ROOT), str(tmp_path / "redis")],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        server = json.loads(starter.stdout.readline())
        assert _alive(server["pid"]), "the server did not start"
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=20)
        deadline = time.monotonic() + 20
        while _alive(server["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server["pid"]), "redis-server outlived the process that started it"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(timeout=20)
        if server["pid"] and _alive(server["pid"]):  # the failure: clean it up here
            os.kill(server["pid"], signal.SIGKILL)
