"""Benchmarks of the tiers, measured side by side with their baselines in one run."""
