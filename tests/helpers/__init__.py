"""Helpers the tests share: fakes, servers, subprocess bodies and common setups."""
