"""What the connector's scheduler and worker sides share: their messages and vLLM's KV shape."""
