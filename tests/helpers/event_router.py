"""A router's view of kvtier's KV events, for the tests of the events waiting for vLLM's
takes: stand-ins for ``VllmEvents`` and for a router that credits what it was told (and
drops a stored chunk whose parent it does not know), and chunks to record."""

from array import array

from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.keys import ChunkKey


class Factory:
    """A stand-in for ``VllmEvents``: (kind, medium, remote, last hash)."""

    def extra_keys(self, request, start, stop):
        return None

    def stored(self, blocks, medium, remote=False):
        return [("stored", medium, remote, blocks.hashes[-1])]

    def removed(self, blocks, medium, remote=False):
        return [("removed", medium, remote, blocks.hashes[-1])]


class Router:
    """What a router credits the engine with, per medium, from the events it was given."""

    def __init__(self) -> None:
        self.held: set[tuple[str, bool, bytes]] = set()

    def apply(self, events) -> int:
        for kind, medium, remote, last in events:
            (self.held.add if kind == "stored" else self.held.discard)((medium, remote, last))
        return len(events)


def chunk(i: int) -> tuple[ChunkKey, ChunkBlocks]:
    h = i.to_bytes(32, "big")
    return ChunkKey(i.to_bytes(16, "big")), ChunkBlocks((h, h), None, array("i", [i] * 32))


def recorded(events: KVEvents, count: int, first: int = 0) -> list[ChunkKey]:
    keys = []
    for i in range(first, first + count):
        key, blocks = chunk(i)
        events.record(key, None, 0, blocks)
        keys.append(key)
    return keys


class Anchored(Router):
    """A router that drops a stored chunk whose parent block it was not told of (vllm-router
    0.1.17: "unknown parent; skipping unanchored store"), as the events of ``Chained`` say."""

    def apply(self, events) -> int:
        known = {last for _, _, last in self.held}
        for kind, medium, remote, last, parent in events:
            if kind == "removed":
                self.held.discard((medium, remote, last))
            elif parent is None or parent in known:
                self.held.add((medium, remote, last))
                known.add(last)
        return len(events)


class Chained(Factory):
    """``Factory``'s events, and the hash of the block before the chunk."""

    def stored(self, blocks, medium, remote=False):
        return [(*event, blocks.parent) for event in super().stored(blocks, medium, remote)]

    def removed(self, blocks, medium, remote=False):
        return [(*event, blocks.parent) for event in super().removed(blocks, medium, remote)]


def prompt(events: KVEvents, count: int, first: int = 0) -> list[ChunkKey]:
    """``count`` chunks of one prompt, recorded: each one's last block the next one's parent."""
    keys, parent = [], None
    for i in range(first, first + count):
        key, blocks = chunk(i)
        events.record(key, None, 0, ChunkBlocks(blocks.hashes, parent, blocks.tokens))
        keys.append(key)
        parent = blocks.hashes[-1]
    return keys
