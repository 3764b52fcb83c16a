import os

# Engines and torch in the tests' processes (and every process they start) let OpenMP's
# threads sleep when idle rather than spin: the tests run several vLLM engines at once on
# two cores, where spinning threads take the cores from the engines that have work (three
# engine runs at once took 0.59x the time with it, one alone the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys

import pytest

from kvtier.layout import KVLayout
from tests.helpers.kv import SMALL


@pytest.fixture
def layout() -> KVLayout:
    return SMALL


@pytest.fixture(scope="session", autouse=True)
def _warm_engine_host():
    """The engine host of tests/helpers/vllm_engine.py ends with the session."""
    yield
    from tests.helpers.vllm_engine import close_warm_host

    close_warm_host()


@pytest.fixture(autouse=True)
def _close_scheduler_sides(monkeypatch):
    """Every connector scheduler side a test builds is closed at its end, as the connector's
    ``shutdown`` does: its threads (the follower of other writers' segments, the halt file's
    watch) would otherwise look at the test's directory for the rest of the session."""
    module = sys.modules.get("kvtier.connector.scheduler.side")  # imported by the tests using it
    if module is None:
        yield
        return
    built, init = [], module.SchedulerSide.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(module.SchedulerSide, "__init__", recorded)
    yield
    for side in built:
        side.close()


def pytest_collection_modifyitems(config, items):
    """Engine tests (``vllm`` mark) first, each module in its own order: with ``make test``'s
    workers (pytest-xdist, ``--dist loadscope``) the longest modules start first instead of
    holding the run's end."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)
