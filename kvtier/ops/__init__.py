"""Offline operations on cache directories: inspect, verify, reclaim, clear."""
