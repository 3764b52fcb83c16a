"""The remote tier's contract (``tests/helpers/remote_contract.py``) on Mooncake Store: a real
``mooncake_master`` and a holder lending it memory, inside a private network namespace
(``tests/test_remote_mooncake.py`` runs this module there), the tiers pure clients whose
bytes cross TCP loopback."""


import pytest

from tests.helpers.mooncake_server import inside_namespace
from tests.helpers.remote_contract import RemoteContract
from tests.helpers.remote_stores import MooncakeStore

if not inside_namespace():
    pytest.skip("runs only inside a private network namespace: tests/test_remote_mooncake.py "
                "starts it there", allow_module_level=True)


class TestMooncakeStore(RemoteContract):
    @pytest.fixture(scope="class")
    @classmethod
    def shared_store(cls, tmp_path_factory):
        store = MooncakeStore(tmp_path_factory.mktemp("contract") / "mooncake")
        yield store
        store.close()
