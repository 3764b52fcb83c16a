"""``KVStore``: the tiers in one process, for use without a serving engine."""
