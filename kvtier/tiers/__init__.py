"""The tiers: bookkeeping (index, policy) and the memory that holds the bytes."""
