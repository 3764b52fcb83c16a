"""kvtier's connector with its KV events held back: vLLM still publishes its own GPU cache's
events, kvtier's host and disk tiers store and load as ever, but a router hears nothing of
them (``kv_connector`` ``KVTierConnectorNoEvents``, ``kv_connector_module_path``
``tests.helpers.quiet_connector``; scripts/bench_router.py's arm without kvtier's events)."""

from __future__ import annotations

from kvtier.connector import KVTierConnector


class KVTierConnectorNoEvents(KVTierConnector):
    def take_events(self) -> list:
        super().take_events()  # taken, so that none wait or count as dropped
        return []
