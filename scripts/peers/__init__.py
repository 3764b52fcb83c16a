"""Peer KV caches that scripts/ttft.py can run side by side with kvtier."""
