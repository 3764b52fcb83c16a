"""kvtier's connector with a page-copy bug, for the tests of sampled checks: each chunk it
stores holds the pages of blocks half the pool away (another request's, or stale: a valid
chunk under the right key, with a valid checksum: wrong KV no checksum catches), written
through to disk, a shared directory's segment and the remote store alike. The bug lasts
while the file named by the extra config key ``mislabel_until`` does not exist (taken out
before kvtier reads its config); ``kv_connector`` ``KVTierConnectorMislabels``,
``kv_connector_module_path`` ``tests.helpers.mislabel_connector``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvtier.connector import KVTierConnector


class OtherPages:
    """A ``PagedKV`` whose gathers (a store's copy of GPU pages) take the blocks half the
    pool away until ``until`` exists."""

    def __init__(self, pages: Any, until: str) -> None:
        self._pages, self._until = pages, until
        self._blocks = len(pages.pages[0])

    def gather(self, block_ids: Sequence[int], slot: Any) -> None:
        if not os.path.exists(self._until):
            far = ((b + self._blocks // 2) % self._blocks for b in block_ids)
            block_ids = tuple(b or 1 for b in far)  # never the null block
        self._pages.gather(block_ids, slot)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pages, name)


class KVTierConnectorMislabels(KVTierConnector):
    until = ""  # the scheduler's and the worker's connectors share one config in a process

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config)
        type(self).until = extra.pop("mislabel_until", None) or type(self).until
        transfer.kv_connector_extra_config = extra
        super().__init__(vllm_config, role, kv_cache_config)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        saves = self._worker_side._saves
        assert saves is not None
        saves.pages = OtherPages(saves.pages, self.until)
