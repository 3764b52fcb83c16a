"""The remote tier's contract (``tests/helpers/remote_contract.py``) on Mooncake Store: a real
``mooncake_master`` and a holder lending it memory, inside a private network namespace
(``tests/test_remote_mooncake.py`` runs this module there), the tiers pure clients whose
bytes cross TCP loopback."""

from typing import ClassVar

import pytest

from tests.helpers.mooncake_server import inside_namespace
from tests.helpers.remote_contract import RemoteContract
from tests.helpers.remote_stores import MooncakeStore

if not inside_namespace():
    pytest.skip("runs only inside a private network namespace: tests/test_remote_mooncake.py "
                "starts it there", allow_module_level=True)


class TestMooncakeStore(RemoteContract):
    broken: ClassVar[dict[str, str]] = {"test_a_read_only_buffer_fails_that_call_only":
              "MooncakeTier.get_many raises ValueError ('assignment destination is read-only') "
              "for a read-only dst outside registered memory: its buffer check skips "
              "`writeable` (RemoteTier._unfit checks it), so a caller's mistake is an "
              "exception, not the IO_ERROR result of that call the contract promises"}

    @pytest.fixture(scope="class")
    @classmethod
    def shared_store(cls, tmp_path_factory):
        store = MooncakeStore(tmp_path_factory.mktemp("contract") / "mooncake")
        yield store
        store.close()
