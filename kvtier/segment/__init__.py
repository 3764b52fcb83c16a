"""One writer's segment of a cache directory: its seat, lease, index, append-only log and slot files."""
