"""Store planning: offering a request's computed chunks to host memory, and to disk and the
remote store.

Each chunk fully computed is offered once, in order: it gets a host slot (write-through:
and a disk slot) and a ``ChunkStore`` in the step's plan, and stays invisible until every
rank reported it stored (``Outcomes``).
"""

from __future__ import annotations

from typing import Any

from kvtier.config.settings import KVTierConfig, WritePolicy
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import NULL_BLOCK, ChunkStore, GroupBlocks, StepPlan, chunk_blocks
from kvtier.connector.scheduler.chunk_records import ChunkHashing, chunk_record
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.events import chunk_blocks as named_blocks
from kvtier.connector.scheduler.records import PendingStores, Tracked
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.connector.scheduler.tails import Tail
from kvtier.connector.scheduler.verify_planner import VerifyPlanner
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

HOST, DISK = TierName.HOST, TierName.DISK


class StorePlanner:
    """Plans the stores of one engine's requests.

    Contract: ``plan`` offers the request's chunks from ``tracked.stored_upto`` on. A chunk
    already cached (or being stored) is only touched; any other gets reservations recorded
    in ``PendingStores``, with the demotions their victims need added to the plan's. The
    offer stops at the first chunk that finds no host slot free (all held by stores and
    loads in flight), leaving ``stored_upto`` there so that the request's next step offers
    it again; and for good past as many chunks as the largest tier holds (``_keep``).
    With ``events`` (vLLM's KV events on), each chunk planned is recorded there for the
    events its tiers raise, and each chunk found cached is made known there. With
    ``hashing`` and a disk tier or a remote store, each chunk planned carries its token
    record.
    """

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, stack: TierStack,
                 pending: PendingStores, remote_writes: RemoteWrites | None = None,
                 events: KVEvents | None = None, verify: VerifyPlanner | None = None,
                 hashing: ChunkHashing | None = None) -> None:
        self.config, self.geometry, self.stack, self._pending = config, geometry, stack, pending
        self._remote_writes, self._events, self._verify = remote_writes, events, verify
        # a token record for each chunk going to disk or the remote store (vLLM's hashing)
        self._records = hashing is not None and (DISK in stack.indexes or remote_writes is not None)
        maker = hashing if hashing is not None else events.factory if events is not None else None
        wanted = self._records or events is not None
        self._extra = maker.extra_keys if maker is not None and wanted else None

    def plan(self, tracked: Tracked, keys: list[ChunkKey], block_ids: GroupBlocks,
             meta: StepPlan, stores: bool = True) -> None:
        """Offer ``keys``, the request's chunks from ``tracked.stored_upto`` on, stored
        from ``block_ids`` (all the request's blocks, per KV cache group). A chunk already
        cached is only touched. One that is not, and that some group keeps no page of any
        more (out of its sliding window by now: vLLM's null block), cannot be stored, nor
        can any after it: the request is done storing (``tracked.store_done``). Without
        ``stores`` (a consumer's sampled request) chunks are only checked, never stored."""
        per, keep = self.geometry.blocks_per_chunk, self._keep()
        touched: list[ChunkKey] = []
        for c, key in enumerate(keys, start=tracked.stored_upto):
            if c >= keep:  # its store would evict the request's own first chunks
                tracked.store_done = True
                break
            ids = chunk_blocks(block_ids, c * per, (c + 1) * per)
            if len(ids) < per * len(block_ids):
                break
            if tracked.verify and c >= tracked.verify_from and self._verify is not None \
                    and self._verify.plan(tracked, key, ids, meta):
                pass  # checked against its pages: kept if right
            elif self._cached(key):  # a hit, say, whose early pages a window has dropped since
                touched.append(key)
                if stores and self._remote_writes is not None:
                    self._remote_writes.again(key)  # its write to the store dropped or failed
                if self._events is not None:
                    self._events.seen(key, tracked.request, c, [
                        tier for tier, index in self.stack.indexes.items() if key in index])
            elif not stores:
                pass  # a consumer's: checked where it was cached, nothing stored
            elif NULL_BLOCK in ids:
                tracked.store_done = True  # its pages are gone, and a chunk needs its prefix
                break
            elif not self._plan_one(key, ids, meta, tracked.request.request_id,
                                    blocks := self._blocks(tracked, c)):
                break
            elif self._events is not None:
                self._events.record(key, tracked.request, c, blocks)
            tracked.stored_upto = c + 1
        for key in reversed(touched):  # last chunk first: a prompt's head the last evicted
            self.stack.touch(key)

    def plan_tail(self, tracked: Tracked, tail: Tail, block_ids: GroupBlocks,
                  meta: StepPlan, stores: bool = True) -> None:
        """Offer the request's prompt tail (its computed prompt's partial last chunk): its
        blocks' pages, the last one partly filled, go into a chunk slot like any chunk's.
        With no host slot free it is offered again at the request's next step. A sampled
        request's tail that is cached has its full blocks checked instead."""
        if tail.index >= self._keep():
            tracked.tail_done = True
            return
        first = tail.index * self.geometry.blocks_per_chunk
        stop = -(-tail.end // self.geometry.block_tokens)
        ids = chunk_blocks(block_ids, first, stop)
        if len(ids) < (stop - first) * len(block_ids) or NULL_BLOCK in ids:
            tracked.tail_done = True  # not all its pages are the request's any more
            return
        full = (tail.end - tail.start) // self.geometry.block_tokens  # its last block: partly
        if full and tracked.verify and tail.index >= tracked.verify_from \
                and self._verify is not None and self._verify.plan(tracked, tail.key, ids, meta,
                                                                   blocks=full):
            pass  # its full blocks checked against their pages: kept if right
        elif self._cached(tail.key):
            self.stack.touch(tail.key)
        elif not stores:
            pass
        elif not self._plan_one(tail.key, ids, meta, tracked.request.request_id):
            return
        tracked.tail_done = tracked.tail_stored = True

    def unstored(self, tracked: Tracked, computed: int, tail: Tail | None) -> int:
        """The chunks (and prompt tail) of a request finishing with ``computed`` tokens
        computed that were never offered for store: no host slot was free at any step since
        (all held by writes to disk or the remote store and by loads in flight). None of a
        request done storing (``store_done``), past ``_keep``, past the tokens vLLM hashed
        (a step's speculative tokens are computed, not all kept), or on a consumer."""
        if tracked.store_done:
            return 0
        keep = self._keep()
        keyed = len(tracked.request.block_hashes) // self.geometry.hashes_per_chunk  # (drafts
        full = min(computed // self.geometry.chunk_tokens, keep, keyed)  # a step counted: none)
        missed = max(0, full - tracked.stored_upto)
        if tail is not None and not tracked.tail_done and computed >= tail.end and tail.index < keep:
            missed += 1
        return missed

    def _keep(self) -> int:
        """The chunks of one request worth storing: as many as the largest tier holds. A
        longer prompt would lose its own first chunks to its later ones, and with them every
        later chunk's hit (a key names its whole prefix). So too with a remote store: its
        writes are made from host slots, and dropped when its queue is full."""
        return max(index.num_slots for index in self.stack.indexes.values())

    def _cached(self, key: ChunkKey) -> bool:
        """Cached, or being stored by another request. Not a host slot reserved for it
        otherwise: a store some rank failed while another rank's write still reads the slot
        (then aborted: offered again once it is over), or a read staging it."""
        return self.stack.locate(key) is not None or key in self._pending.host

    def record(self, request: Any, chunk: int) -> bytes:
        """The token record of ``request``'s chunk ``chunk`` (b"" where none is kept)."""
        if not self._records or self._extra is None:
            return b""
        return chunk_record(named_blocks(request, self.geometry, chunk, self._extra), self.geometry)

    def _blocks(self, tracked: Tracked, chunk: int) -> ChunkBlocks | None:
        """Chunk ``chunk`` of the request as events and its token record name it (worked out
        once for both); None where neither is wanted, or vLLM has not hashed it all."""
        if self._extra is None:
            return None
        return named_blocks(tracked.request, self.geometry, chunk, self._extra)

    def _plan_one(self, key: ChunkKey, ids: tuple[int, ...], meta: StepPlan, req_id: str,
                  blocks: ChunkBlocks | None = None) -> bool:
        """Plan the store of request ``req_id``'s chunk not cached (with the token record of
        its ``blocks``); False when no host slot is free for it now."""
        plan = self.stack.plan_store(key, HOST)
        if plan is None:
            return False
        meta.demotions += self._pending.demotion_writes(plan.demotions)
        disk = None
        if (DISK in self.stack.indexes and self.config.write_policy is WritePolicy.WRITE_THROUGH
                and not self.stack.indexes[DISK].has_entry(key)):
            disk_plan = self.stack.plan_store(key, DISK)
            disk = disk_plan.dst if disk_plan is not None else None
        self._pending.host[key] = (plan.dst, disk)
        if disk is not None:
            self._pending.disk[key] = (disk, plan.dst)
        record = chunk_record(blocks, self.geometry) if self._records else b""
        remote = self._remote_writes is not None and self._remote_writes.with_store(key, record)
        meta.stores.append(ChunkStore(key, ids, plan.dst.slot, disk.slot if disk else None,
                                      remote, record, req_id))
        return True
