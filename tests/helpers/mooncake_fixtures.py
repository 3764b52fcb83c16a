"""The fixtures of the Mooncake store tests run in a private network namespace: a master and
metadata server of their own (``server``) and the tiers a test made, closed at its end
(``tiers``)."""

from __future__ import annotations

import pytest

from kvtier.remote.mooncake_tier import MooncakeTier
from tests.helpers.mooncake_server import MooncakeServer


@pytest.fixture
def server(tmp_path):
    srv = MooncakeServer(tmp_path / "mooncake").start()
    yield srv
    srv.stop()


@pytest.fixture
def tiers():
    made: list[MooncakeTier] = []
    yield made
    for t in made:
        t.close()
