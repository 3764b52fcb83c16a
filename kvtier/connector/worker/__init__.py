"""The connector's worker side: the bytes of each load and store, between vLLM's pages and the tiers."""
