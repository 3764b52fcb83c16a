"""The Redis tier on the oldest redis-py kvtier takes (pyproject's ``remote`` extra: 5.3),
whose cluster client builds its nodes, asks for the slot map and drops connections other
than the release the rest of the suite runs on: the cluster's round trips, redirects and a
slot moved under load, a TLS cluster, a TLS handshake within the deadline, one server's
contract, in a fresh process with that release first on its path."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.redis_server import needs_redis

pytestmark = needs_redis
OLDEST = "5.3.0"
ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_redis_redirects.py",
         "tests/test_remote_cluster.py::test_a_slot_moved_under_load_is_a_miss_of_its_key_and_"
         "fails_no_other_round_trip",
         "tests/test_remote_cluster.py::test_a_hung_node_costs_its_own_keys_and_the_others_nodes_"
         "are_served",
         "tests/test_remote_cluster.py::test_a_tls_cluster_gets_the_ca_and_client_certificate_"
         "the_url_names",
         "tests/test_deadline_connect.py",
         "tests/test_remote_contract.py"]


def test_the_cluster_and_server_tests_pass_on_the_oldest_redis_py(tmp_path):
    where = tmp_path / "redis-py"
    got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                          str(where), f"redis=={OLDEST}"], capture_output=True, text=True,
                         timeout=300)
    if got.returncode != 0:
        pytest.skip(f"redis-py {OLDEST} could not be installed: {got.stderr[-500:]}")
    check = "import redis, sys; sys.exit(redis.__version__ != sys.argv[1])"
    env = {"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    assert subprocess.run([sys.executable, "-c", check, OLDEST], env=env, cwd=ROOT).returncode == 0
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--basetemp={tmp_path / 'inner'}", *TESTS], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "passed" in summary and "skipped" not in summary, \
        f"on redis-py {OLDEST}:\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
